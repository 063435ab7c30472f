//! One pool (one maru-server) of a handler: its session, its mover and its core.
//! `core` is the state and rules (sans-I/O); `store`, `load` and `in_place` drive
//! them; `session` calls maru-server (`wire`: its hot calls' encodings); `stats`
//! is what a pool counts. Here: the pool, its heartbeat and tick, and the
//! calls on keys. Its one lock is the core's ([`core::CoreCell`]), never held across
//! a copy, a transfer, a round trip, a connect or a fence.
pub(crate) mod core;
#[cfg(test)]
mod core_tests;
mod deferred;
mod held;
mod in_place;
mod load;
pub(crate) mod peers;
pub mod session;
mod stats;
mod store;
mod wire;

use self::core::{BeatCheck, CoreCell, Gone, PoolCore};
use super::clock::Deadline;
use super::error::WorkerError;
use super::movers::Mover;
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
pub use deferred::MAX_QUEUED_RELEASES;
pub use in_place::{InPlacePage, InPlaceWrite};
pub use load::{Release, ReleaseQueue};
use peers::WriteTargets;
use serde::Serialize;
use session::Session;
pub use stats::PoolStats;
use std::sync::Arc;
use std::time::Duration;
pub use store::AheadQueue;

/// A request's timeout unless `with_timeout` says otherwise (`timeout_ms`'s default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long opening a pool waits for its agents to prove the key (`greet_agents`).
const GREET_WAIT: Duration = Duration::from_secs(2);

/// Pages a pool keeps allocated ahead (in the same `alloc` as a store's), so that most
/// stores need no `alloc` of their own.
pub const SPARE_PAGES: usize = 32;

/// Bytes of pages a pool keeps allocated ahead at least: with small pages that is more
/// than `SPARE_PAGES` (128 of 256 KiB), so that a store of 32 such chunks makes an
/// `alloc` one batch in five instead of one in two (as one of 32 × 2 MiB still does:
/// its `alloc` is under 1 % of its copy). Half of what `SPARE_PAGES` of 2 MiB hold.
pub const SPARE_BYTES: u64 = 32 << 20;

/// Most spare pages a pool keeps (an `alloc` of smaller pages names them all).
pub const MAX_SPARE_PAGES: usize = 4 * SPARE_PAGES;

/// The spare pages of a pool of pages of `page_size` bytes in regions of
/// `region_size` bytes: `SPARE_BYTES` of them, from `SPARE_PAGES` to
/// `MAX_SPARE_PAGES`, but above `SPARE_PAGES` only up to a quarter of a region, so
/// that keeping spares never makes a pool take a region it does not need (with small
/// regions a spare refill would otherwise ask for a whole new one).
pub fn spare_pages(page_size: u64, region_size: u64) -> usize {
    let per_page = |bytes: u64| usize::try_from(bytes / page_size.max(1)).unwrap_or(usize::MAX);
    let quarter_region = per_page(region_size / 4).max(SPARE_PAGES);
    per_page(SPARE_BYTES)
        .clamp(SPARE_PAGES, MAX_SPARE_PAGES)
        .min(quarter_region)
}

/// Bytes of pages evicted ahead of need with each `victims` round trip: 128 pages of
/// 256 KiB (one eviction per four batches of 32), a sliver of any pool.
pub const EVICT_AHEAD_BYTES: u64 = 32 << 20;
/// Pages evicted ahead at least.
pub const EVICT_AHEAD_PAGES: usize = 16;

/// Writes the batch items `(index, page)` through the pool, by the request's
/// deadline; true where complete.
type PageWriter<'w> =
    dyn FnMut(&StoragePool, &[(usize, PageGrant)], &WriteTargets, Deadline) -> Vec<bool> + 'w;
/// Reads the found items (their batch indices and leases) through the pool, by the
/// request's deadline; answers (chunks read, their bytes).
type LeaseReader<'r> =
    dyn FnMut(&[usize], &[LeaseGrant], &StoragePool, Deadline) -> (u64, u64) + 'r;
/// A test hook run between a store's copy and its publish (see `TestHooks`).
pub type BeforePublish = Box<dyn Fn(&StoragePool, &[PageGrant]) + Send + Sync>;
/// A test hook run before the mover adopts a region (see `TestHooks`).
pub type BeforeAdopt = Box<dyn Fn(&RegionGrant) + Send + Sync>;
/// A test hook that sees each chunk written and says whether it is (see `TestHooks`).
pub type AfterWrite = Box<dyn Fn(&PageGrant, bool) -> bool + Send + Sync>;

/// Faults and observation points a test puts into a pool (cargo feature
/// `test-hooks`; never set by the library itself).
#[derive(Default)]
pub struct TestHooks {
    /// Runs after a store's bytes were written into its pages and before they are
    /// published (a test makes a region vanish there).
    pub before_publish: Option<BeforePublish>,
    /// Runs when maru-server gave a region, before the pool notes it and adopts it.
    pub before_adopt: Option<BeforeAdopt>,
    /// Sees each chunk a store wrote and says whether its bytes are complete.
    pub after_write: Option<AfterWrite>,
    /// Pretends a transfer of unknown outcome may still land.
    pub unfenced: bool,
    /// While set, the tick finds the agent of every own region silent too long.
    pub silent: Option<Arc<std::sync::atomic::AtomicBool>>,
}

pub struct StoragePool {
    pub session: Session,
    /// The pool's state and rules, behind its one lock.
    core: Arc<CoreCell>,
    mover: Box<dyn Mover>,
    max_batch: usize,
    /// A request's timeout (`timeout_ms`): every wait of it ends this long after it
    /// started (see `Deadline`).
    timeout: Duration,
    hooks: TestHooks,
    /// Set by a call that found the next region due ahead of need; the handler then
    /// queues the pool for its ahead thread (`AheadQueue`).
    ahead_due: std::sync::atomic::AtomicBool,
}

impl StoragePool {
    pub fn open(session: Session, mover: Box<dyn Mover>) -> Result<StoragePool, WorkerError> {
        let core = mover
            .core()
            .unwrap_or_else(|| Arc::new(CoreCell::new(PoolCore::new(None))));
        core.lock().wants_lead = mover.wants_lead();
        let max_batch = session.handshake.max_batch.max(1);
        let pool = StoragePool {
            session,
            core,
            mover,
            max_batch,
            timeout: DEFAULT_TIMEOUT,
            hooks: TestHooks::default(),
            ahead_due: Default::default(),
        };
        if let Err(e) = pool.start(pool.deadline()) {
            pool.session.close_failed_open(&e, pool.deadline());
            return Err(e);
        }
        Ok(pool)
    }

    /// Has the mover make a region the session took usable, with an INFO line.
    pub(super) fn adopt_region(
        &self,
        grant: &RegionGrant,
        by: Deadline,
    ) -> Result<(), WorkerError> {
        self.mover.adopt(grant, by)?;
        let (h, url) = (&grant.handle, &self.session.url);
        let at = match &grant.agent {
            None => format!("writable at offset {} of {}", h.offset, grant.pool.path),
            Some(agent) => format!("at agent {agent}"),
        };
        let (id, len, pages) = (h.region_id, h.length, grant.pages);
        log::info!("pool {url}: region {id} mapped {at} ({len} bytes, {pages} pages)");
        Ok(())
    }

    /// Maps the session's first region, if any, and reports its boot id.
    fn start(&self, by: Deadline) -> Result<(), WorkerError> {
        if let Some(r) = self.session.first_region.clone() {
            self.adopt_region(&r, by)?;
            self.core.lock().adopted(&r);
        }
        self.report_boots(by)
    }

    /// Bounds each request by `timeout` from its start (10 s by default).
    pub fn with_timeout(mut self, timeout: Duration) -> StoragePool {
        self.timeout = timeout;
        self
    }

    /// Keeps up to about `n` allocated pages for the next stores (`SPARE_PAGES`).
    pub fn with_spare_pages(self, n: usize) -> StoragePool {
        self.core.lock().spare_target = n;
        self
    }

    /// Holds at most `max_bytes` of regions (whole regions, at least one; 0: no
    /// limit): past it, stores evict the session's own keys instead of expanding.
    pub fn with_max_bytes(self, max_bytes: u64) -> StoragePool {
        let region = self.session.handshake.region_size.max(1);
        let max = (max_bytes > 0).then(|| (max_bytes / region).max(1));
        self.core.lock().max_regions = max;
        self
    }

    /// Test hooks (see [`TestHooks`]).
    #[cfg(feature = "test-hooks")]
    pub fn with_test_hooks(mut self, hooks: TestHooks) -> StoragePool {
        self.hooks = hooks;
        self
    }

    /// Connects to the pool's agents (`remote_cxl`) within [`GREET_WAIT`], so that an
    /// agent key that does not prove fails the open ([`WorkerError::Auth`]).
    pub(crate) fn greet_agents(&self) -> Result<(), WorkerError> {
        let by = Deadline::after(self.timeout.min(GREET_WAIT));
        self.mover.greet(&self.session.handshake.agents, by)
    }

    /// The deadline of a request starting now.
    pub(crate) fn deadline(&self) -> Deadline {
        Deadline::after(self.timeout)
    }

    /// A heartbeat when maru-server must hear boot ids before anything is published.
    fn report_boots(&self, by: Deadline) -> Result<(), WorkerError> {
        let must = self.core.lock().must_report();
        if must {
            self.heartbeat(by)?;
        }
        Ok(())
    }

    /// Counters of the pool (prefaulting included).
    pub fn stats(&self) -> PoolStats {
        let prefaulted = self.mover.prefault_stats().map_or(0, |p| p.bytes);
        let mut s = self.core.lock().stats.clone();
        s.prefaulted_bytes = prefaulted;
        s
    }

    pub fn page_size(&self) -> u64 {
        self.session.page_size
    }

    /// Pins (`pin`) or unpins found keys, a batch of at most `max_batch` at a time.
    pub fn pin<K: Serialize>(&self, keys: &[K], pin: bool) -> Result<Vec<bool>, WorkerError> {
        self.per_batch(keys, |s, k, by| s.pin(k, pin, by))
    }

    /// Unpublishes keys this session stored (see `RemoveResult` for the others).
    pub fn remove<K: Serialize>(
        &self,
        keys: &[K],
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        self.per_batch(keys, |s, k, by| s.remove(k, by))
    }

    pub fn exists<K: Serialize>(&self, keys: &[K]) -> Result<Vec<bool>, WorkerError> {
        if self.session.away() {
            // maru-server did not answer a call by its deadline: false at once.
            return Ok(vec![false; keys.len()]);
        }
        self.per_batch(keys, |s, k, by| s.exists(k, by))
    }

    /// One session call per `max_batch` keys, all by one request deadline.
    fn per_batch<K, T>(
        &self,
        keys: &[K],
        call: impl Fn(&Session, &[K], Deadline) -> Result<Vec<T>, WorkerError>,
    ) -> Result<Vec<T>, WorkerError> {
        let by = self.deadline();
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(call(&self.session, chunk, by)?);
        }
        Ok(out)
    }

    /// Heartbeat: the own regions and their boot ids (`heartbeat_begin`: a reboot's
    /// report waits for older publishes), then what the reply decides carried out
    /// (`heartbeat_answered`). Every wait by `by`; no lock across the round trip.
    pub fn heartbeat(&self, by: Deadline) -> Result<(), WorkerError> {
        let check = self
            .core
            .wait_while(by, |c| c.heartbeat_begin() == BeatCheck::Wait)
            .heartbeat_begin();
        let (boots, regions) = match check {
            BeatCheck::Go { boots, regions } => (boots, regions),
            BeatCheck::Wait => {
                return Err(WorkerError::Timeout(format!(
                    "pool {}: the report of a reboot waited {} ms for publishes still unanswered",
                    self.session.url,
                    self.timeout.as_millis()
                )))
            }
        };
        let skipped = self.core.lock().stats.skipped;
        let reply = self
            .session
            .heartbeat(boots.clone(), regions, skipped, by)?;
        let gone = self.core.lock().heartbeat_answered(&boots, &reply);
        self.core.notify();
        for id in &reply.rebooted_regions {
            log::warn!(
                "pool {}: maru-server dropped the keys of region {id}: its memory node rebooted",
                self.session.url
            );
        }
        self.carry_out(gone, by);
        Ok(())
    }

    /// Carries out what the core decided about regions the pool no longer writes
    /// into: the mover forgets them; one maru-server asked for is returned.
    pub(super) fn carry_out(&self, gone: Vec<Gone>, by: Deadline) {
        for g in gone {
            self.mover.forget(g.region());
            match g {
                Gone::Lost(id) => log::warn!(
                    "pool {}: region {id} is no longer this session's at maru-server (taken back while idle for another engine's fair share of a full pool, or its memory went back to the resource manager): its keys are gone and nothing more is written into it",
                    self.session.url,
                ),
                Gone::GiveBack(id) => {
                    let r = self.session.return_region(id, false, by);
                    self.core.lock().given_back(r.is_ok());
                    match r {
                        Ok(()) => log::info!(
                            "pool {}: region {id} given back for another engine's fair share of the full pool",
                            self.session.url
                        ),
                        Err(e) => log::warn!(
                            "pool {}: region {id} could not be given back ({e}); nothing more is written into it and maru-server asks again",
                            self.session.url
                        ),
                    }
                }
            }
        }
    }

    /// Between ticks (every `lifecycle::AWAY_PROBE_EVERY_MS`): probes of the agents,
    /// and of maru-server, that are away.
    pub fn probe_away(&self, now_ms: u64, by: Deadline) {
        self.mover.probe_away(now_ms, by);
        if self.session.away() {
            if let Err(e) = self.session.ping(by) {
                log::debug!("pool {}: maru-server still away: {e}", self.session.url);
            }
        }
    }

    /// Periodic work (about once a second): the mover's probes; regions of agents
    /// silent too long returned once no publish into them is in flight; a reboot
    /// found reported.
    pub fn tick(&self, now_ms: u64, by: Deadline) -> Result<(), WorkerError> {
        let mut silent = self.mover.tick(now_ms, by);
        if self
            .hooks
            .silent
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
        {
            silent.extend(self.core.lock().own_regions());
        }
        let ready = {
            let mut c = self.core.lock();
            c.going(&silent);
            c.returnable()
        };
        for id in ready {
            self.mover.forget(id);
            match self.session.return_region(id, false, by) {
                Ok(()) | Err(WorkerError::Refused { .. }) => {
                    self.core.lock().lose(id);
                    log::warn!(
                        "pool {}: region {id} given back: its agent did not answer for too long (its keys go)",
                        self.session.url
                    );
                }
                Err(e) => return Err(e),
            }
        }
        self.report_boots(by)
    }

    /// The maru-server this pool's session lived in restarted: release the session's
    /// regions at their agents (see `Mover::release_all`).
    pub fn release_regions(&self) -> (usize, usize) {
        self.mover.release_all()
    }

    pub fn close(&self, by: Deadline) -> Result<(), WorkerError> {
        // maru-server hears the boot ids at a drained close too (the keeper compares
        // them): ask the agents first, so a reboot not seen yet is reported now.
        self.mover.check_agents(super::clock::now_ms());
        if let Err(e) = self.heartbeat(by) {
            log::warn!(
                "pool {}: heartbeat before close failed: {e}",
                self.session.url
            );
        }
        let spare = self.core.lock().take_spare(usize::MAX);
        if let Err(e) = self.session.free_pages(&spare, by) {
            log::warn!(
                "pool {}: cannot return {} spare pages before closing: {e}",
                self.session.url,
                spare.len()
            );
        }
        self.session.close(by)
    }
}
