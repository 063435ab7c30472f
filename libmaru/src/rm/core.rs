//! The resource manager as a state machine: requests, connection events and time go
//! in, replies and reaped regions come out. No sockets, threads or clocks.
//!
//! Durability: every change is saved before its reply. When a save fails the change
//! stays in memory, because it is real (an agent may already act on a hold, an owner
//! on a FREE that went draining), and the reply is a storage error, never a refusal:
//! only a refusal tells a caller that nothing is held. Until a save succeeds again
//! the core is *dirty*, and a retried request that finds its change already made
//! saves again and succeeds only when that save does, so an agent never registers a
//! region on the strength of a hold that a restart could lose.

use super::error::RmError;
use super::extents::ExtentAllocator;
use super::holds::HoldLedger;
use super::owners::OwnerTimers;
use super::replies::{Replay, ReplyCache};
use super::state::{HoldRecord, RegionRecord, RmState, STATE_VERSION};
use super::store::{PersistError, StateStore};
use crate::auth::{random_bytes, region_token, token_matches};
use crate::dax::{DeviceInfo, DeviceKind};
use crate::wire::rm::{
    AccessReply, AllocReply, FreeReply, Handle, HoldInfo, HoldReply, PoolInfo, RegionInfo,
    ResetHoldsReply, RmReply, RmRequest, UnholdReply,
};
use crate::wire::{ErrorCode, WireError};
use std::collections::{BTreeMap, BTreeSet};

/// How long an owner without a connection keeps its regions, unless configured.
pub const DEFAULT_GRACE_MS: u64 = 30_000;
/// Largest region that may be asked for (2^48 bytes).
pub const MAX_ALLOC_SIZE: u64 = 1 << 48;
/// `pool_id` listed for a region whose pool is not present at this RM.
pub const ABSENT_POOL: u32 = u32::MAX;
/// Longest node name accepted in holds.
pub const MAX_NODE_NAME: usize = 255;

struct Pool {
    dev: DeviceInfo,
    extents: ExtentAllocator,
}

struct Region {
    rec: RegionRecord,
    /// Index in `pools`; `None` when the pool with its UUID is not present.
    pool: Option<usize>,
    token: String,
}

/// A request carried out in memory, before saving: its reply, whether it changed
/// the state, and what it did (for the storage error if the save fails).
struct Done {
    reply: RmReply,
    changed: bool,
    what: String,
}

/// The resource manager core. Pools are numbered by their index in the list given
/// to [`open`](Self::open).
pub struct ResourceManager {
    pools: Vec<Pool>,
    regions: BTreeMap<u64, Region>,
    holds: HoldLedger,
    next_region_id: u64,
    store: Box<dyn StateStore>,
    secret: [u8; 32],
    /// A change is in memory that the last save did not make durable.
    dirty: bool,
    replies: ReplyCache,
    owners: OwnerTimers,
}

fn refused(msg: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::Refused, msg)
}

fn kind_name(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::DevDax => "devdax",
        DeviceKind::File => "file",
    }
}

fn check_node_name(node: &str) -> Result<(), WireError> {
    if node.is_empty() || node.len() > MAX_NODE_NAME || node.chars().any(char::is_control) {
        return Err(refused(format!(
            "bad node name {node:?}: it must be 1 to {MAX_NODE_NAME} bytes without control \
             characters"
        )));
    }
    Ok(())
}

fn draining_refusal(region_id: u64) -> WireError {
    refused(format!(
        "region {region_id} is draining: freed while held; it cannot be held again"
    ))
}

impl ResourceManager {
    /// Builds the core from `pools` and the state in `store`: regions and holds come
    /// back, each pool's free space is rebuilt around its regions, and every owner
    /// of regions gets a grace period from `now_ms` to reconnect. A region whose
    /// pool is not in `pools` is kept and listed but cannot be mapped until its pool
    /// is back.
    pub fn open(
        pools: Vec<DeviceInfo>,
        mut store: Box<dyn StateStore>,
        secret: [u8; 32],
        now_ms: u64,
    ) -> Result<ResourceManager, RmError> {
        for (i, a) in pools.iter().enumerate() {
            if let Some(b) = pools[i + 1..].iter().find(|b| b.uuid == a.uuid) {
                return Err(RmError::DuplicatePool {
                    uuid: a.uuid.clone(),
                    first: a.path.clone(),
                    second: b.path.clone(),
                });
            }
        }
        let state = store.load()?.unwrap_or_else(RmState::empty);
        let pools = pools
            .into_iter()
            .map(|dev| Pool {
                extents: ExtentAllocator::new(dev.data_offset, dev.device_size, dev.align),
                dev,
            })
            .collect();
        let mut rm = ResourceManager {
            pools,
            regions: BTreeMap::new(),
            holds: HoldLedger::new(),
            next_region_id: 1,
            store,
            secret,
            dirty: false,
            replies: ReplyCache::default(),
            owners: OwnerTimers::new(DEFAULT_GRACE_MS),
        };
        rm.restore(state, now_ms)?;
        Ok(rm)
    }

    fn restore(&mut self, state: RmState, now_ms: u64) -> Result<(), RmError> {
        if state.version != STATE_VERSION {
            return Err(RmError::Inconsistent(format!(
                "state version {} (this build reads version {STATE_VERSION})",
                state.version
            )));
        }
        self.next_region_id = state.next_region_id.max(1);
        for rec in state.regions {
            let id = rec.region_id;
            if id == 0 || id >= self.next_region_id {
                return Err(RmError::Inconsistent(format!(
                    "region {id} is not below the next region id {}",
                    self.next_region_id
                )));
            }
            if self.regions.contains_key(&id) {
                return Err(RmError::Inconsistent(format!(
                    "region {id} is listed twice"
                )));
            }
            let pool = self.pools.iter().position(|p| p.dev.uuid == rec.pool_uuid);
            match pool {
                Some(i) => {
                    let p = &mut self.pools[i];
                    p.extents.reserve(rec.offset, rec.length).map_err(|e| {
                        RmError::Inconsistent(format!(
                            "region {id} of {} on pool {i} ({}): {e}",
                            rec.owner, p.dev.path
                        ))
                    })?;
                }
                None => log::warn!(
                    "region {id} of {} is on pool UUID {}, which is not present: it is kept \
                     and listed but cannot be mapped until that device is back",
                    rec.owner,
                    rec.pool_uuid
                ),
            }
            let token = region_token(&self.secret, id, rec.offset, rec.length, rec.nonce);
            self.regions.insert(id, Region { rec, pool, token });
        }
        for h in state.holds {
            if !self.regions.contains_key(&h.region_id) {
                return Err(RmError::Inconsistent(format!(
                    "node {} (epoch {}) holds region {}, which is not listed",
                    h.node, h.epoch, h.region_id
                )));
            }
            self.holds.hold(h.region_id, &h.node, h.epoch);
        }
        // A draining region without holds cannot be saved by this code (its last
        // UNHOLD frees it in the same save), but finish it rather than keep it forever.
        let drained: Vec<u64> = self
            .regions
            .iter()
            .filter(|(id, r)| r.rec.draining && !self.holds.is_held(**id))
            .map(|(id, _)| *id)
            .collect();
        for &id in &drained {
            log::warn!("region {id} was draining with no hold left: freeing it");
            self.finish_free(id);
        }
        if !drained.is_empty() {
            if let Err(e) = self.persist() {
                log::error!("saving the state after freeing drained regions: {e}");
            }
        }
        let owners: BTreeSet<String> = self
            .regions
            .values()
            .filter(|r| !r.rec.draining)
            .map(|r| r.rec.owner.clone())
            .collect();
        for owner in owners {
            self.owners.start(&owner, now_ms);
        }
        Ok(())
    }

    /// Sets the grace period of owners without a connection (also for timers
    /// already running).
    pub fn set_grace_ms(&mut self, grace_ms: u64) {
        self.owners.set_grace_ms(grace_ms);
    }

    pub fn grace_ms(&self) -> u64 {
        self.owners.grace_ms()
    }

    /// True while a change is in memory that no save has made durable yet.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Carries out one request of client `client_id` (the identity its connection
    /// proved). Errors are what the client gets back; see [`ErrorCode`] for which
    /// ones mean that nothing was done.
    pub fn handle(
        &mut self,
        client_id: &str,
        req: RmRequest,
        now_ms: u64,
    ) -> Result<RmReply, WireError> {
        let request_id = match &req {
            RmRequest::Alloc { request_id, .. } | RmRequest::Free { request_id, .. } => *request_id,
            _ => 0,
        };
        if request_id == 0 {
            return self.dispatch(client_id, req);
        }
        match self.replies.lookup(client_id, request_id, &req, now_ms) {
            Some(Replay::Reply(reply)) => {
                self.sync_if_dirty(&format!("replayed request {request_id}"))?;
                return Ok(reply);
            }
            Some(Replay::Mismatch) => {
                return Err(WireError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "request_id {request_id} of {client_id} was already used for another \
                         request; use a new id for each request (the same one only for a retry)"
                    ),
                ))
            }
            None => {}
        }
        let done = self.execute(client_id, req.clone())?;
        self.replies
            .insert(client_id, request_id, req, done.reply.clone(), now_ms);
        self.finish(done)
    }

    fn dispatch(&mut self, client_id: &str, req: RmRequest) -> Result<RmReply, WireError> {
        let done = self.execute(client_id, req)?;
        self.finish(done)
    }

    /// Carries out a request in memory; listings come back as unchanged `Done`s.
    fn execute(&mut self, client_id: &str, req: RmRequest) -> Result<Done, WireError> {
        let unchanged = |reply| Done {
            reply,
            changed: false,
            what: String::new(),
        };
        match req {
            RmRequest::Alloc { size, pool, .. } => self.alloc(client_id, size, pool.as_deref()),
            RmRequest::Free { handle, .. } => self.free(client_id, &handle),
            RmRequest::GetAccess { handle } => self.access(&handle).map(unchanged),
            RmRequest::Hold {
                handle,
                node,
                epoch,
            } => self.hold(&handle, &node, epoch),
            RmRequest::Unhold {
                region_id,
                node,
                epoch,
            } => Ok(self.unhold(region_id, &node, epoch)),
            RmRequest::ResetHolds { node, epoch } => {
                check_node_name(&node)?;
                let removed = self.holds.reset(&node, epoch);
                Ok(self.after_holds_removed(
                    removed,
                    format!("reset of holds of node {node} before epoch {epoch}"),
                ))
            }
            RmRequest::DropHolds { node, confirm } => {
                check_node_name(&node)?;
                if !confirm {
                    return Err(WireError::new(
                        ErrorCode::BadRequest,
                        format!(
                            "drop_holds drops every hold of node {node}, whatever its epoch, \
                             and lets their ranges be reused: do it only for a node gone for \
                             good, and pass confirm: true (maru-rm-ctl drop-holds {node} \
                             --confirm)"
                        ),
                    ));
                }
                let removed = self.holds.drop_node(&node);
                Ok(self.after_holds_removed(removed, format!("drop of holds of node {node}")))
            }
            RmRequest::Pools => Ok(unchanged(RmReply::Pools {
                pools: (0..self.pools.len()).map(|i| self.pool_info(i)).collect(),
            })),
            RmRequest::Regions { owner } => Ok(unchanged(RmReply::Regions {
                regions: self.region_infos(owner.as_deref(), client_id),
            })),
            RmRequest::Holds { node } => Ok(unchanged(RmReply::Holds {
                holds: self.holds.list(node.as_deref()),
            })),
        }
    }

    /// Applies the durability rule to a request carried out in memory.
    fn finish(&mut self, done: Done) -> Result<RmReply, WireError> {
        if done.changed {
            self.commit(&done.what)?;
        } else {
            self.sync_if_dirty(&done.what)?;
        }
        Ok(done.reply)
    }

    /// Saves the state; on failure the core stays dirty.
    fn persist(&mut self) -> Result<(), PersistError> {
        let state = self.snapshot();
        match self.store.save(&state) {
            Ok(()) => {
                self.dirty = false;
                Ok(())
            }
            Err(e) => {
                self.dirty = true;
                Err(e)
            }
        }
    }

    fn commit(&mut self, what: &str) -> Result<(), WireError> {
        self.persist().map_err(|e| {
            WireError::new(
                ErrorCode::Storage,
                format!(
                    "{what}: done in memory, but saving the state failed: {e}; it stays in \
                     effect; retry the request (a retry saves again)"
                ),
            )
        })
    }

    /// A request that found its change already made succeeds only once that change
    /// is durable: save again if an earlier save failed.
    fn sync_if_dirty(&mut self, what: &str) -> Result<(), WireError> {
        if !self.dirty {
            return Ok(());
        }
        self.persist().map_err(|e| {
            let what = if what.is_empty() { "request" } else { what };
            WireError::new(
                ErrorCode::Storage,
                format!(
                    "{what}: already in effect in memory, but an earlier change is not yet \
                     durable and saving the state failed again: {e}; retry the request"
                ),
            )
        })
    }

    fn snapshot(&self) -> RmState {
        RmState {
            version: STATE_VERSION,
            next_region_id: self.next_region_id,
            regions: self.regions.values().map(|r| r.rec.clone()).collect(),
            holds: self
                .holds
                .list(None)
                .into_iter()
                .map(|h| HoldRecord {
                    region_id: h.region_id,
                    node: h.node,
                    epoch: h.epoch,
                })
                .collect(),
        }
    }

    fn alloc(&mut self, owner: &str, size: u64, pool: Option<&str>) -> Result<Done, WireError> {
        let bad = |m: String| WireError::new(ErrorCode::BadRequest, m);
        if owner.is_empty() {
            return Err(bad(
                "alloc needs a client id (the owner of the region)".into()
            ));
        }
        if size == 0 || size > MAX_ALLOC_SIZE {
            return Err(bad(format!(
                "alloc of {size} bytes: the size must be 1 to 2^48 bytes"
            )));
        }
        if self.pools.is_empty() {
            return Err(WireError::new(
                ErrorCode::NoPool,
                "this resource manager has no pools; add a DAX device or fake-DAX file and \
                 restart it",
            ));
        }
        let candidates: Vec<usize> = match pool {
            Some(sel) => vec![self.find_pool(sel)?],
            None => (0..self.pools.len()).collect(),
        };
        let nonce_bytes = random_bytes(8).map_err(|e| {
            WireError::new(
                ErrorCode::Internal,
                format!("alloc: the kernel gave no random bytes for the token nonce: {e}"),
            )
        })?;
        let mut nonce = [0u8; 8];
        nonce.copy_from_slice(&nonce_bytes);
        let nonce = u64::from_le_bytes(nonce);
        for i in candidates.iter().copied() {
            let p = &mut self.pools[i];
            let (Some(length), Some(offset)) = (p.extents.aligned_len(size), p.extents.alloc(size))
            else {
                continue;
            };
            let region_id = self.next_region_id;
            self.next_region_id += 1;
            let rec = RegionRecord {
                region_id,
                owner: owner.to_string(),
                pool_uuid: p.dev.uuid.clone(),
                offset,
                length,
                requested: size,
                nonce,
                draining: false,
            };
            let token = region_token(&self.secret, region_id, offset, length, nonce);
            let handle = Handle {
                region_id,
                offset,
                length,
                token: token.clone(),
            };
            self.regions.insert(
                region_id,
                Region {
                    rec,
                    pool: Some(i),
                    token,
                },
            );
            log::info!("region {region_id}: {length} bytes at {offset:#x} of pool {i} for {owner}");
            return Ok(Done {
                reply: RmReply::Alloc(AllocReply {
                    handle,
                    requested: size,
                    pool: self.pool_info(i),
                }),
                changed: true,
                what: format!("alloc of region {region_id} for {owner}"),
            });
        }
        let largest: Vec<String> = candidates
            .iter()
            .map(|&i| {
                let p = &self.pools[i];
                format!(
                    "pool {i} ({}) {} bytes, align {}",
                    p.dev.path,
                    p.extents.largest_free(),
                    p.extents.align()
                )
            })
            .collect();
        Err(WireError::new(
            ErrorCode::NoSpace,
            format!(
                "no room for {size} bytes; largest free extent: {}; free regions, or wait for \
                 draining ones to be unheld",
                largest.join(", ")
            ),
        ))
    }

    fn find_pool(&self, sel: &str) -> Result<usize, WireError> {
        let by_id = sel.parse::<usize>().ok().filter(|&i| i < self.pools.len());
        let found = by_id.or_else(|| {
            self.pools
                .iter()
                .position(|p| p.dev.path == sel || p.dev.uuid.eq_ignore_ascii_case(sel))
        });
        found.ok_or_else(|| {
            let known: Vec<String> = self
                .pools
                .iter()
                .enumerate()
                .map(|(i, p)| format!("{i} {} {}", p.dev.path, p.dev.uuid))
                .collect();
            WireError::new(
                ErrorCode::NoPool,
                format!(
                    "no pool {sel:?}; give a pool id, path or UUID of: {}",
                    known.join("; ")
                ),
            )
        })
    }

    /// The region a handle names, if the handle is one this RM issued for it.
    fn check_handle(&self, h: &Handle) -> Result<&Region, WireError> {
        let r = self.regions.get(&h.region_id).ok_or_else(|| {
            refused(format!(
                "region {} is not allocated (freed, or never allocated by this RM)",
                h.region_id
            ))
        })?;
        if r.rec.offset != h.offset
            || r.rec.length != h.length
            || !token_matches(&r.token, &h.token)
        {
            return Err(refused(format!(
                "bad token for region {}: this handle was not issued by this RM for that \
                 region",
                h.region_id
            )));
        }
        Ok(r)
    }

    fn free(&mut self, client_id: &str, h: &Handle) -> Result<Done, WireError> {
        let r = self.check_handle(h)?;
        let id = h.region_id;
        if r.rec.owner != client_id {
            return Err(WireError::new(
                ErrorCode::Permission,
                format!(
                    "region {id} belongs to {}, not {client_id}: only its owner may free it",
                    r.rec.owner
                ),
            ));
        }
        let what = format!("free of region {id}");
        if r.rec.draining {
            return Ok(Done {
                reply: RmReply::Free(FreeReply { draining: true }),
                changed: false,
                what,
            });
        }
        let draining = self.release(id);
        Ok(Done {
            reply: RmReply::Free(FreeReply { draining }),
            changed: true,
            what,
        })
    }

    fn access(&self, h: &Handle) -> Result<RmReply, WireError> {
        let r = self.check_handle(h)?;
        if r.rec.draining {
            return Err(draining_refusal(h.region_id));
        }
        let p = self.region_pool(r)?;
        Ok(RmReply::Access(AccessReply {
            region_id: r.rec.region_id,
            path: p.dev.path.clone(),
            uuid: p.dev.uuid.clone(),
            offset: r.rec.offset,
            length: r.rec.length,
            align: p.extents.align(),
        }))
    }

    /// The pool of a region; a missing pool is not a refusal (the region exists and
    /// works again once its device is back).
    fn region_pool(&self, r: &Region) -> Result<&Pool, WireError> {
        r.pool.map(|i| &self.pools[i]).ok_or_else(|| {
            WireError::new(
                ErrorCode::NoPool,
                format!(
                    "region {} is on pool UUID {}, which is not present at this RM; bring the \
                     device back and restart the RM",
                    r.rec.region_id, r.rec.pool_uuid
                ),
            )
        })
    }

    fn hold(&mut self, h: &Handle, node: &str, epoch: u64) -> Result<Done, WireError> {
        check_node_name(node)?;
        let r = self.check_handle(h)?;
        let id = h.region_id;
        if r.rec.draining {
            return Err(draining_refusal(id));
        }
        self.region_pool(r)?;
        let added = self.holds.hold(id, node, epoch);
        Ok(Done {
            reply: RmReply::Hold(HoldReply {
                holds: self.holds.count(id),
            }),
            changed: added,
            what: format!("hold of region {id} by node {node} (epoch {epoch})"),
        })
    }

    fn unhold(&mut self, region_id: u64, node: &str, epoch: u64) -> Done {
        let removed = self.holds.unhold(region_id, node, epoch);
        let freed = removed && self.finish_if_drained(region_id);
        Done {
            reply: RmReply::Unhold(UnholdReply { removed, freed }),
            changed: removed,
            what: format!("unhold of region {region_id} by node {node} (epoch {epoch})"),
        }
    }

    fn after_holds_removed(&mut self, removed: Vec<HoldInfo>, what: String) -> Done {
        let regions: BTreeSet<u64> = removed.iter().map(|h| h.region_id).collect();
        let freed = regions
            .into_iter()
            .filter(|&id| self.finish_if_drained(id))
            .count();
        Done {
            reply: RmReply::ResetHolds(ResetHoldsReply {
                removed: removed.len(),
                freed,
            }),
            changed: !removed.is_empty(),
            what,
        }
    }

    /// Frees a region as its owner's FREE does: a held region goes draining, its
    /// range kept until the last UNHOLD. Returns whether it went draining.
    fn release(&mut self, id: u64) -> bool {
        if self.holds.is_held(id) {
            if let Some(r) = self.regions.get_mut(&id) {
                r.rec.draining = true;
                log::info!("region {id} freed while held: draining until its last unhold");
            }
            true
        } else {
            self.finish_free(id);
            false
        }
    }

    /// Finishes freeing a draining region that has no hold left. Returns whether it
    /// did.
    fn finish_if_drained(&mut self, id: u64) -> bool {
        let drained = self
            .regions
            .get(&id)
            .is_some_and(|r| r.rec.draining && !self.holds.is_held(id));
        if drained {
            self.finish_free(id);
        }
        drained
    }

    /// Forgets a region and gives its range back to its pool.
    fn finish_free(&mut self, id: u64) {
        let Some(r) = self.regions.remove(&id) else {
            return;
        };
        if let Some(i) = r.pool {
            if let Err(e) = self.pools[i].extents.free(r.rec.offset, r.rec.length) {
                // Only a bug can get here: regions never overlap.
                log::error!("region {id}: giving its range back to pool {i} failed: {e}");
            }
        }
        log::info!("region {id} of {} is free", r.rec.owner);
    }

    fn pool_info(&self, i: usize) -> PoolInfo {
        let p = &self.pools[i];
        let draining = self
            .regions
            .values()
            .filter(|r| r.pool == Some(i) && r.rec.draining)
            .map(|r| r.rec.length)
            .sum();
        PoolInfo {
            pool_id: i as u32,
            path: p.dev.path.clone(),
            uuid: p.dev.uuid.clone(),
            kind: kind_name(p.dev.kind).to_string(),
            total: p.extents.total(),
            free: p.extents.free_bytes(),
            align: p.extents.align(),
            draining,
        }
    }

    /// Regions (of `owner`, or all). An owner asking for its own regions also gets
    /// their tokens: a restarted owner (maru-server) frees a region its records lost.
    fn region_infos(&self, owner: Option<&str>, asker: &str) -> Vec<RegionInfo> {
        self.regions
            .values()
            .filter(|r| owner.is_none() || owner == Some(r.rec.owner.as_str()))
            .map(|r| RegionInfo {
                token: (owner == Some(asker) && !r.rec.draining).then(|| {
                    region_token(
                        &self.secret,
                        r.rec.region_id,
                        r.rec.offset,
                        r.rec.length,
                        r.rec.nonce,
                    )
                }),
                region_id: r.rec.region_id,
                owner: r.rec.owner.clone(),
                pool_id: r.pool.map_or(ABSENT_POOL, |i| i as u32),
                offset: r.rec.offset,
                length: r.rec.length,
                requested: r.rec.requested,
                state: if r.rec.draining {
                    "draining"
                } else {
                    "allocated"
                }
                .to_string(),
                holds: self.holds.holders(r.rec.region_id),
            })
            .collect()
    }

    fn owns_regions(&self, owner: &str) -> bool {
        self.regions
            .values()
            .any(|r| !r.rec.draining && r.rec.owner == owner)
    }

    /// A connection of `client_id` opened: its grace timer, if running, stops.
    pub fn client_connected(&mut self, client_id: &str) {
        self.owners.connected(client_id);
    }

    /// A connection of `client_id` closed. When it was its last and it owns regions,
    /// its grace period starts at `now_ms`.
    pub fn client_disconnected(&mut self, client_id: &str, now_ms: u64) {
        let owns = self.owns_regions(client_id);
        if self.owners.disconnected(client_id, owns, now_ms) {
            log::info!(
                "{client_id} has no connection left: its regions go in {} ms unless it \
                 reconnects",
                self.owners.grace_ms()
            );
        }
    }

    /// Reaps the regions of every owner whose grace period is over; returns their
    /// ids.
    pub fn tick(&mut self, now_ms: u64) -> Vec<u64> {
        let mut reaped = Vec::new();
        for owner in self.owners.expired(now_ms) {
            reaped.extend(self.reap(&owner, "did not reconnect within the grace period"));
        }
        self.persist_after_reap(&reaped);
        reaped
    }

    /// Reaps the regions of `client_id` now (its process is known to be gone).
    pub fn owner_gone(&mut self, client_id: &str) -> Vec<u64> {
        self.owners.cancel(client_id);
        let reaped = self.reap(client_id, "is gone");
        self.persist_after_reap(&reaped);
        reaped
    }

    /// When [`tick`](Self::tick) has work next.
    pub fn next_deadline(&self) -> Option<u64> {
        self.owners.next_deadline()
    }

    fn reap(&mut self, owner: &str, why: &str) -> Vec<u64> {
        let ids: Vec<u64> = self
            .regions
            .values()
            .filter(|r| !r.rec.draining && r.rec.owner == owner)
            .map(|r| r.rec.region_id)
            .collect();
        if !ids.is_empty() {
            log::info!("{owner} {why}: reaping its regions {ids:?}");
        }
        for &id in &ids {
            self.release(id);
        }
        ids
    }

    fn persist_after_reap(&mut self, reaped: &[u64]) {
        if reaped.is_empty() {
            return;
        }
        if let Err(e) = self.persist() {
            log::error!(
                "reaped regions {reaped:?} but saving the state failed: {e}; the next \
                 request saves again"
            );
        }
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
