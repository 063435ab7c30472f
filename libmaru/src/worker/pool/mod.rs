//! One pool (one maru-server) of a handler: its storage session and its mover.
//! Store = pages → bytes into the region → publish (publish only after the bytes are
//! complete). Load = leases → READ/copy → release the leases.
//!
//! `store` and `load` hold those paths; `session` the calls to maru-server. Here: the
//! pool itself, its heartbeat and tick (the region lifecycle's reports and
//! give-backs), and the calls on keys.

mod in_place;
mod load;
pub mod session;
mod store;

use super::error::WorkerError;
use super::movers::Mover;
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
pub use in_place::{InPlacePage, InPlaceWrite};
use session::Session;
use std::collections::VecDeque;

/// Pages a handler's pool keeps allocated ahead (taken in the same `alloc` as the
/// pages a store needs), so that most stores need no `alloc` round trip of their own.
pub const SPARE_PAGES: usize = 32;

/// Counters of a pool, reported by `stats()`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PoolStats {
    pub stored: u64,
    pub store_skipped: u64,
    pub already_present: u64,
    pub bytes_stored: u64,
    pub hits: u64,
    pub misses: u64,
    pub load_failed: u64,
    pub bytes_loaded: u64,
    pub regions: u64,
    /// Regions taken before the session's regions were full (see `Mover::wants_lead`).
    pub regions_ahead: u64,
    /// Bytes of own regions faulted in off the store path (`cxl`).
    pub prefaulted_bytes: u64,
    /// Regions maru-server no longer counted among the session's (see `heartbeat`),
    /// or given back because their agent stayed silent (see `tick`).
    pub regions_lost: u64,
    /// Why the last load that failed failed (an agent's refusal, say).
    pub last_load_error: Option<String>,
    /// Keys of the session's own regions removed to make room for new stores, and
    /// their bytes.
    pub evictions: u64,
    pub bytes_evicted: u64,
    /// Regions given back because maru-server asked for a fair share of a full pool.
    pub regions_given_back: u64,
    /// Chunks not stored because no page could be found or made free (every page of
    /// the session leased or pinned, and no region to be had).
    pub store_no_room: u64,
}

impl PoolStats {
    /// Adds another pool's counters (the handler's total); the last load error is
    /// the other's when it has one.
    pub fn add(&mut self, s: &PoolStats) {
        let PoolStats {
            stored,
            store_skipped,
            already_present,
            bytes_stored,
            hits,
            misses,
            load_failed,
            bytes_loaded,
            regions,
            regions_ahead,
            prefaulted_bytes,
            regions_lost,
            last_load_error,
            evictions,
            bytes_evicted,
            regions_given_back,
            store_no_room,
        } = s;
        // Every field named above: a new counter must be added here to compile.
        self.stored += stored;
        self.store_skipped += store_skipped;
        self.already_present += already_present;
        self.bytes_stored += bytes_stored;
        self.hits += hits;
        self.misses += misses;
        self.load_failed += load_failed;
        self.bytes_loaded += bytes_loaded;
        self.regions += regions;
        self.regions_ahead += regions_ahead;
        self.prefaulted_bytes += prefaulted_bytes;
        self.regions_lost += regions_lost;
        if last_load_error.is_some() {
            self.last_load_error.clone_from(last_load_error);
        }
        self.evictions += evictions;
        self.bytes_evicted += bytes_evicted;
        self.regions_given_back += regions_given_back;
        self.store_no_room += store_no_room;
    }
}

/// Bytes of pages evicted ahead of need with each `victims` round trip (at least
/// `EVICT_AHEAD_PAGES` pages), so that the stores after it find free pages without
/// the two round trips of an eviction of their own: 32 MiB is 128 pages of 256 KiB
/// (one eviction per four batches of 32) and a sliver of any pool.
pub const EVICT_AHEAD_BYTES: u64 = 32 << 20;
/// Pages evicted ahead at least.
pub const EVICT_AHEAD_PAGES: usize = 16;

/// Writes the batch items `(index, page)` with the mover; true where complete.
type PageWriter<'w> = dyn FnMut(&mut dyn Mover, &[(usize, PageGrant)]) -> Vec<bool> + 'w;
/// Reads the found items (their batch indices and leases) with the mover.
type LeaseReader<'r> = dyn FnMut(&[usize], &[LeaseGrant], &mut dyn Mover) + 'r;

pub struct StoragePool {
    pub session: Session,
    mover: Box<dyn Mover>,
    stats: PoolStats,
    max_batch: usize,
    /// Pages of the session's regions allocated to it, holding no key and no write
    /// in flight: used by the next stores before asking maru-server for more.
    spare: VecDeque<PageGrant>,
    /// The region adopted last and its page count: when stores reach its second half,
    /// the next region is taken ahead (for movers that want a lead).
    newest: Option<(u64, u64)>,
    /// The newest region for which a region was taken (or tried) ahead already.
    lead_tried: Option<u64>,
    /// Pages to take ahead with each `alloc` (0: none, unused pages are freed at once);
    /// at most twice as many are kept.
    spare_target: usize,
    /// Most regions the session takes (`max_bytes`); none: no limit.
    max_regions: Option<u64>,
    /// Per region, pages taken for writing in place and not yet published or given
    /// back (see `in_place`).
    in_place: std::collections::BTreeMap<u64, usize>,
}
impl StoragePool {
    pub fn open(session: Session, mut mover: Box<dyn Mover>) -> Result<StoragePool, WorkerError> {
        if let Some(r) = &session.first_region {
            mover.adopt(r)?;
        }
        let max_batch = session.handshake.max_batch.max(1);
        let newest = session.first_region.as_ref().map(region_pages);
        let mut pool = StoragePool {
            stats: PoolStats {
                regions: u64::from(session.first_region.is_some()),
                ..PoolStats::default()
            },
            session,
            mover,
            max_batch,
            spare: VecDeque::new(),
            newest,
            lead_tried: None,
            spare_target: 0,
            max_regions: None,
            in_place: Default::default(),
        };
        pool.report_boots()?;
        Ok(pool)
    }

    /// Tells maru-server the boot ids of the own regions (a heartbeat) when the mover
    /// says it must hear them before anything else is published (a new region, or a
    /// memory node that rebooted: maru-server then drops that region's keys).
    fn report_boots(&mut self) -> Result<(), WorkerError> {
        if self.mover.must_report() {
            self.heartbeat()?;
        }
        Ok(())
    }

    /// Keeps up to about `n` allocated pages for the next stores (see `SPARE_PAGES`):
    /// they count as used at maru-server until a store fills them or the pool closes.
    pub fn with_spare_pages(mut self, n: usize) -> StoragePool {
        self.spare_target = n;
        self
    }

    /// Holds at most `max_bytes` of regions (whole regions, at least one; 0: no
    /// limit): past it, stores evict the session's own keys instead of expanding.
    pub fn with_max_bytes(mut self, max_bytes: u64) -> StoragePool {
        let region = self.session.handshake.region_size.max(1);
        self.max_regions = (max_bytes > 0).then(|| (max_bytes / region).max(1));
        self
    }

    /// Counters of the pool (prefaulting included).
    pub fn stats(&self) -> PoolStats {
        let mut s = self.stats.clone();
        s.prefaulted_bytes = self.mover.prefault_stats().map_or(0, |p| p.bytes);
        s
    }

    pub fn page_size(&self) -> u64 {
        self.session.page_size
    }

    /// Pins (`pin`) or unpins found keys, a batch of at most `max_batch` at a time.
    pub fn pin(&mut self, keys: &[String], pin: bool) -> Result<Vec<bool>, WorkerError> {
        if pin {
            self.per_batch(keys, Session::pin)
        } else {
            self.per_batch(keys, Session::unpin)
        }
    }

    /// Unpublishes keys this session stored (see `RemoveResult` for the others).
    pub fn remove(
        &mut self,
        keys: &[String],
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        self.per_batch(keys, Session::remove)
    }

    pub fn exists(&mut self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        self.per_batch(keys, Session::exists)
    }

    /// One session call per `max_batch` keys, the answers in order.
    fn per_batch<T>(
        &mut self,
        keys: &[String],
        call: impl Fn(&mut Session, &[String]) -> Result<Vec<T>, WorkerError>,
    ) -> Result<Vec<T>, WorkerError> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(call(&mut self.session, chunk)?);
        }
        Ok(out)
    }

    pub fn heartbeat(&mut self) -> Result<(), WorkerError> {
        self.mover.reclaim();
        let boots = self.mover.boot_ids();
        let regions = self
            .mover
            .own_regions()
            .into_iter()
            .filter(|r| !boots.contains_key(r))
            .collect();
        let reply = self.session.heartbeat(boots.clone(), regions)?;
        self.mover.reported(&boots);
        for id in &reply.rebooted_regions {
            log::warn!(
                "pool {}: maru-server dropped the keys of region {id}: its memory node rebooted",
                self.session.url
            );
        }
        for id in reply.unknown_regions {
            self.lose_region(id);
        }
        for id in reply.give_back {
            self.give_back_region(id);
        }
        Ok(())
    }

    /// maru-server asks for one of the session's regions: the pool is full and
    /// another storing engine waits while this one holds more than its share. No store
    /// is in flight (the pool is locked); nothing more is written into the region, its
    /// spare pages go, and it is returned (its keys go, maru-server releases it at its
    /// agent before the RM frees it).
    fn give_back_region(&mut self, id: u64) {
        if self.taken_in_place(id) {
            log::info!(
                "pool {}: region {id} not given back yet: pages of it are being written in place; maru-server asks again",
                self.session.url
            );
            return;
        }
        self.spare.retain(|p| p.region_id != id);
        self.mover.forget_region(id);
        if self.newest.is_some_and(|(r, _)| r == id) {
            self.newest = None;
        }
        match self.session.return_region(id, false) {
            Ok(()) => {
                self.stats.regions = self.stats.regions.saturating_sub(1);
                self.stats.regions_given_back += 1;
                log::info!(
                    "pool {}: region {id} given back for another engine's fair share of the \
                     full pool",
                    self.session.url
                );
            }
            Err(e) => log::warn!(
                "pool {}: region {id} could not be given back ({e}); nothing more is written \
                 into it and maru-server asks again",
                self.session.url
            ),
        }
    }

    /// Periodic work (about once a second): the mover probes the agents of own
    /// regions; regions whose agent stayed silent too long are given back to
    /// maru-server (their keys go at once; its keeper releases them at the agent);
    /// a reboot found is reported.
    pub fn tick(&mut self, now_ms: u64) -> Result<(), WorkerError> {
        for id in self.mover.tick(now_ms) {
            match self.session.return_region(id, false) {
                Ok(()) | Err(WorkerError::Refused(_)) => self.lose_region(id),
                Err(e) => return Err(e),
            }
        }
        self.report_boots()
    }

    /// maru-server says the region is no longer the session's (the RM took it back
    /// while maru-server could not reach it, say): the spare pages in it go, and
    /// nothing more is written into it. Stores go on in the session's other regions.
    fn lose_region(&mut self, id: u64) {
        let before = self.spare.len();
        self.spare.retain(|p| p.region_id != id);
        self.mover.forget_region(id);
        if self.newest.is_some_and(|(r, _)| r == id) {
            self.newest = None;
        }
        self.stats.regions = self.stats.regions.saturating_sub(1);
        self.stats.regions_lost += 1;
        log::warn!(
            "pool {}: region {id} is no longer this session's (its memory went back to the resource manager): {} spare page(s) in it dropped; nothing more is written into it",
            self.session.url,
            before - self.spare.len()
        );
    }

    /// The maru-server this pool's session lived in restarted: release the session's
    /// regions at their agents (see `Mover::release_all`).
    pub fn release_regions(&mut self) -> (usize, usize) {
        self.mover.release_all()
    }

    pub fn close(&mut self) -> Result<(), WorkerError> {
        // maru-server hears the boot ids at a drained close too (the keeper compares
        // them): ask the agents first, so a reboot not seen yet is reported now.
        self.mover.check_agents(super::clock::now_ms());
        if let Err(e) = self.heartbeat() {
            log::warn!(
                "pool {}: heartbeat before close failed: {e}",
                self.session.url
            );
        }
        let spare: Vec<PageGrant> = self.spare.drain(..).collect();
        if let Err(e) = self.session.free_pages(&spare) {
            log::warn!(
                "pool {}: cannot return {} spare pages before closing: {e}",
                self.session.url,
                spare.len()
            );
        }
        self.session.close()
    }
}

/// A region's id and page count.
fn region_pages(g: &RegionGrant) -> (u64, u64) {
    (g.handle.region_id, g.pages)
}
