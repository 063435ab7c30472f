//! One pool (one maru-server) of a handler: its storage session and its mover.
//! Store = pages → bytes into the region → publish (publish only after the bytes are
//! complete). Load = leases → READ/copy → release the leases.
//!
//! `store` and `load` hold those paths; `session` the calls to maru-server. Here: the
//! pool itself, its heartbeat and tick (the region lifecycle's reports and
//! give-backs), and the calls on keys.
//!
//! Threads share a pool (`&self` everywhere). What each lock guards:
//! - `book`: the bookkeeping (spare pages, the regions stores are writing into, the
//!   newest region, stats). Held for a few map operations, never across a copy, a
//!   transfer or a round trip.
//! - `mover`: the mover's own state (mappings, agents, the region lifecycle). `cxl`
//!   copies run without it (the mover hands out the region's mapping, see
//!   `Mover::direct`); `remote_cxl` transfers too (the mover hands out its
//!   `Transfers`, which lock the mover's state only to post and settle a window).
//! - `gate`: publishes share it; what changes which regions are the session's or
//!   what their boot ids are (heartbeat, tick) takes it alone. So a publish that
//!   re-checked its regions under the gate cannot race with their loss.
//!
//! Lock order: gate → mover → book; calls to maru-server hold neither mover nor book.
mod in_place;
mod load;
pub mod session;
mod store;

use super::clock::Deadline;
use super::error::WorkerError;
use super::movers::{Mover, Transfers};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
pub use in_place::{InPlacePage, InPlaceWrite};
use session::Session;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

/// A request's timeout unless `with_timeout` says otherwise (`timeout_ms`'s default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Writes the batch items `(index, page)` through the pool, by the request's
/// deadline; true where complete.
type PageWriter<'w> = dyn FnMut(&StoragePool, &[(usize, PageGrant)], Deadline) -> Vec<bool> + 'w;
/// Reads the found items (their batch indices and leases) through the pool, by the
/// request's deadline.
type LeaseReader<'r> = dyn FnMut(&[usize], &[LeaseGrant], &StoragePool, Deadline) + 'r;
/// A test hook run between a store's copy and its publish (see `before_publish`).
pub type BeforePublish = Box<dyn Fn(&StoragePool, &[PageGrant]) + Send + Sync>;
/// A test hook run before the mover adopts a region the session took (see
/// `with_before_adopt`).
pub type BeforeAdopt = Box<dyn Fn(&RegionGrant) + Send + Sync>;

/// How a request's bytes move (see `StoragePool::data_path`).
#[derive(Clone)]
enum DataPath {
    /// Through the mover's transfers, without the mover's lock (`remote_cxl`).
    Transfers(Arc<dyn Transfers>),
    /// Copies through the mover's mappings, looked up chunk by chunk (`cxl`).
    Direct,
    /// Through the mover, under its lock.
    Mover,
}

/// The pool's bookkeeping, under its short lock.
#[derive(Default)]
struct Book {
    stats: PoolStats,
    /// Pages of the session's regions allocated to it, holding no key and no write
    /// in flight: used by the next stores before asking maru-server for more.
    spare: VecDeque<PageGrant>,
    /// The region adopted last and its page count: when stores reach its second half,
    /// the next region is taken ahead (for movers that want a lead).
    newest: Option<(u64, u64)>,
    /// The newest region for which a region was taken (or tried) ahead already.
    lead_tried: Option<u64>,
    /// Per region: pages handed to stores whose publish has not finished. Such a
    /// region is not given back (maru-server asks again at the next heartbeat).
    writing: HashMap<u64, usize>,
    /// Regions being taken now (an `expand` in flight), counted against `max_bytes`.
    expanding: u64,
    /// When maru-server last had no region to give (see `EXPAND_BACKOFF_MS`).
    refused_at: Option<u64>,
    /// Regions maru-server asked for while stores wrote into them: no new store
    /// writes into them, and the last store that does gives them back.
    closing: std::collections::HashSet<u64>,
}

pub struct StoragePool {
    pub session: Session,
    mover: Mutex<Box<dyn Mover>>,
    /// How requests move bytes, from the mover at open.
    path: DataPath,
    book: Mutex<Book>,
    gate: RwLock<()>,
    /// Taking a region (expand + the mover's adopt) holds it alone; an `alloc` that got
    /// pages of a region the mover does not know yet takes it shared, so it waits
    /// until that region is usable (maru-server allocates from any region of the
    /// session).
    adopting: RwLock<()>,
    max_batch: usize,
    /// Pages to take ahead with each `alloc` (0: none, unused pages are freed at once);
    /// at most twice as many are kept.
    spare_target: usize,
    /// Most regions the session takes (`max_bytes`); none: no limit.
    max_regions: Option<u64>,
    /// A request's timeout (`timeout_ms`): its waits on agents (connects, calls,
    /// transfers, fences) end this long after it started (see `Deadline`).
    timeout: Duration,
    before_publish: Option<BeforePublish>,
    before_adopt: Option<BeforeAdopt>,
}

impl StoragePool {
    pub fn open(session: Session, mut mover: Box<dyn Mover>) -> Result<StoragePool, WorkerError> {
        if let Some(r) = &session.first_region {
            mover.adopt(r)?;
        }
        let path = match mover.transfers() {
            Some(t) => DataPath::Transfers(t),
            None if mover.writes_direct() => DataPath::Direct,
            None => DataPath::Mover,
        };
        let max_batch = session.handshake.max_batch.max(1);
        let newest = session.first_region.as_ref().map(region_pages);
        let pool = StoragePool {
            book: Mutex::new(Book {
                stats: PoolStats {
                    regions: u64::from(session.first_region.is_some()),
                    ..PoolStats::default()
                },
                newest,
                ..Book::default()
            }),
            session,
            mover: Mutex::new(mover),
            path,
            gate: RwLock::new(()),
            adopting: RwLock::new(()),
            max_batch,
            spare_target: 0,
            max_regions: None,
            timeout: DEFAULT_TIMEOUT,
            before_publish: None,
            before_adopt: None,
        };
        pool.report_boots()?;
        Ok(pool)
    }

    /// The bookkeeping (a poisoned lock is taken over: its data is counters and lists
    /// that a panic between two statements leaves usable).
    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mover(&self) -> MutexGuard<'_, Box<dyn Mover>> {
        self.mover.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How a request moves bytes (decided at open: a request takes no lock to ask).
    fn data_path(&self) -> DataPath {
        self.path.clone()
    }

    /// Tells maru-server the boot ids of the own regions (a heartbeat) when the mover
    /// says it must hear them before anything else is published (a new region, or a
    /// memory node that rebooted: maru-server then drops that region's keys).
    fn report_boots(&self) -> Result<(), WorkerError> {
        let must = self.mover().must_report();
        if must {
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

    /// Bounds each request's waits on agents by `timeout` from its start (10 s by
    /// default, as `timeout_ms`).
    pub fn with_timeout(mut self, timeout: Duration) -> StoragePool {
        self.timeout = timeout;
        self
    }

    /// Connects to the pool's agents (`remote_cxl`), so that an agent key that does
    /// not prove fails the open ([`WorkerError::Auth`]) rather than the first store.
    pub(crate) fn greet_agents(&self) -> Result<(), WorkerError> {
        match self.data_path() {
            DataPath::Transfers(t) => t.greet(&self.session.handshake.agents, self.deadline()),
            DataPath::Direct | DataPath::Mover => Ok(()),
        }
    }

    /// The deadline of a request starting now.
    fn deadline(&self) -> Deadline {
        Deadline::after(self.timeout)
    }

    /// Holds at most `max_bytes` of regions (whole regions, at least one; 0: no
    /// limit): past it, stores evict the session's own keys instead of expanding.
    pub fn with_max_bytes(mut self, max_bytes: u64) -> StoragePool {
        let region = self.session.handshake.region_size.max(1);
        self.max_regions = (max_bytes > 0).then(|| (max_bytes / region).max(1));
        self
    }

    /// Test hook: `f(pool, pages)` runs after a store's bytes were written into
    /// `pages` and before they are published (a test makes a region vanish there).
    #[doc(hidden)]
    pub fn with_before_publish(mut self, f: BeforePublish) -> StoragePool {
        self.before_publish = Some(f);
        self
    }

    /// Test hook: `f(grant)` runs before the mover adopts each region the session takes
    /// after the pool opened (a test makes the adoption slow there).
    #[doc(hidden)]
    pub fn with_before_adopt(mut self, f: BeforeAdopt) -> StoragePool {
        self.before_adopt = Some(f);
        self
    }

    /// Counters of the pool (prefaulting included).
    pub fn stats(&self) -> PoolStats {
        let prefaulted = self.mover().prefault_stats().map_or(0, |p| p.bytes);
        let mut s = self.book().stats.clone();
        s.prefaulted_bytes = prefaulted;
        s
    }

    pub fn page_size(&self) -> u64 {
        self.session.page_size
    }

    /// Pins (`pin`) or unpins found keys, a batch of at most `max_batch` at a time.
    pub fn pin(&self, keys: &[String], pin: bool) -> Result<Vec<bool>, WorkerError> {
        if pin {
            self.per_batch(keys, Session::pin)
        } else {
            self.per_batch(keys, Session::unpin)
        }
    }

    /// Unpublishes keys this session stored (see `RemoveResult` for the others).
    pub fn remove(
        &self,
        keys: &[String],
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        self.per_batch(keys, Session::remove)
    }

    pub fn exists(&self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        self.per_batch(keys, Session::exists)
    }

    /// One session call per `max_batch` keys, the answers in order.
    fn per_batch<T>(
        &self,
        keys: &[String],
        call: impl Fn(&Session, &[String]) -> Result<Vec<T>, WorkerError>,
    ) -> Result<Vec<T>, WorkerError> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(call(&self.session, chunk)?);
        }
        Ok(out)
    }

    /// Heartbeat: tells maru-server the own regions and their boot ids; regions it no
    /// longer counts as the session's are lost, regions it asks for are given back.
    /// Takes the gate alone: no publish runs meanwhile.
    pub fn heartbeat(&self) -> Result<(), WorkerError> {
        let _gate = self.gate.write().unwrap_or_else(|e| e.into_inner());
        self.heartbeat_gated()
    }

    fn heartbeat_gated(&self) -> Result<(), WorkerError> {
        let (boots, regions) = {
            let m = self.mover();
            let boots = m.boot_ids();
            let regions = m
                .own_regions()
                .into_iter()
                .filter(|r| !boots.contains_key(r))
                .collect();
            (boots, regions)
        };
        let reply = self.session.heartbeat(boots.clone(), regions)?;
        self.mover().reported(&boots);
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
    /// another storing engine waits while this one holds more than its share. While a
    /// store writes into it, it is closing: no new store takes a page of it, and the
    /// last store that wrote into it gives it back (`give_back_closed`); else nothing more is written
    /// into it (a store looks its mapping up after it marked its pages, under the same
    /// locks), its spare pages go, and it is returned (its keys go, maru-server
    /// releases it at its agent before the RM frees it).
    fn give_back_region(&self, id: u64) {
        {
            let mut m = self.mover();
            let mut b = self.book();
            b.spare.retain(|p| p.region_id != id);
            if b.writing.get(&id).copied().unwrap_or(0) > 0 {
                log::debug!(
                    "pool {}: region {id} is asked for while a store writes into it: given back when that store is done",
                    self.session.url
                );
                b.closing.insert(id);
                return;
            }
            b.closing.remove(&id);
            m.forget_region(id);
            if b.newest.is_some_and(|(r, _)| r == id) {
                b.newest = None;
            }
        }
        match self.session.return_region(id, false) {
            Ok(()) => {
                let mut b = self.book();
                b.stats.regions = b.stats.regions.saturating_sub(1);
                b.stats.regions_given_back += 1;
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

    /// Gives back a closing region whose last store is done (see `give_back_region`).
    pub(super) fn give_back_closed(&self, id: u64) {
        let _gate = self.gate.write().unwrap_or_else(|e| e.into_inner());
        self.give_back_region(id);
    }

    /// Periodic work (about once a second): the mover probes the agents of own
    /// regions; regions whose agent stayed silent too long are given back to
    /// maru-server (their keys go at once; its keeper releases them at the agent);
    /// a reboot found is reported. The probes hold no pool lock (`remote_cxl` ticks
    /// through its transfers: a probe of an agent slow to answer holds no request);
    /// what they found is acted on under the gate alone (it changes which regions may
    /// be published into). A probe that finds a reboot while a publish is in flight
    /// changes the regions' boot ids, so a publish re-checked after it skips their
    /// chunks; one re-checked before it is answered before the report below, which
    /// makes maru-server drop those keys.
    pub fn tick(&self, now_ms: u64) -> Result<(), WorkerError> {
        let back = match self.data_path() {
            DataPath::Transfers(t) => t.tick(now_ms),
            DataPath::Direct | DataPath::Mover => self.mover().tick(now_ms),
        };
        let _gate = self.gate.write().unwrap_or_else(|e| e.into_inner());
        for id in back {
            match self.session.return_region(id, false) {
                Ok(()) | Err(WorkerError::Refused { .. }) => self.lose_region(id),
                Err(e) => return Err(e),
            }
        }
        let must = self.mover().must_report();
        if must {
            self.heartbeat_gated()?;
        }
        Ok(())
    }

    /// maru-server says the region is no longer the session's (the RM took it back
    /// while maru-server could not reach it, say): the spare pages in it go, and
    /// nothing more is written into it (no copy starts into it from now on; a store
    /// that wrote into it does not publish). Stores go on in the session's other
    /// regions.
    #[doc(hidden)]
    pub fn lose_region(&self, id: u64) {
        let dropped = {
            let mut m = self.mover();
            let mut b = self.book();
            let before = b.spare.len();
            b.spare.retain(|p| p.region_id != id);
            m.forget_region(id);
            if b.newest.is_some_and(|(r, _)| r == id) {
                b.newest = None;
            }
            b.closing.remove(&id);
            b.stats.regions = b.stats.regions.saturating_sub(1);
            b.stats.regions_lost += 1;
            before - b.spare.len()
        };
        log::warn!(
            "pool {}: region {id} is no longer this session's (its memory went back to the resource manager): {dropped} spare page(s) in it dropped; nothing more is written into it",
            self.session.url,
        );
    }

    /// The maru-server this pool's session lived in restarted: release the session's
    /// regions at their agents (see `Mover::release_all`).
    pub fn release_regions(&self) -> (usize, usize) {
        self.mover().release_all()
    }

    pub fn close(&self) -> Result<(), WorkerError> {
        // maru-server hears the boot ids at a drained close too (the keeper compares
        // them): ask the agents first, so a reboot not seen yet is reported now.
        let now = super::clock::now_ms();
        match self.data_path() {
            DataPath::Transfers(t) => t.check_agents(now),
            DataPath::Direct | DataPath::Mover => self.mover().check_agents(now),
        }
        if let Err(e) = self.heartbeat() {
            log::warn!(
                "pool {}: heartbeat before close failed: {e}",
                self.session.url
            );
        }
        let spare: Vec<PageGrant> = self.book().spare.drain(..).collect();
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
