//! One pool (one maru-server) of a handler: its storage session, its mover and its
//! core. Store = pages → bytes into the region → publish (publish only after the
//! bytes are complete). Load = leases → READ/copy → release the leases.
//!
//! `core` is the pool's state and rules (sans-I/O); `store`, `load` and `in_place`
//! drive them; `session` makes the calls to maru-server. Here: the pool itself, its
//! heartbeat and tick (reports, regions lost and given back), and the calls on keys.
//!
//! Threads share a pool (`&self` everywhere). Its one lock is the core's
//! ([`core::CoreCell`]), taken for a few map operations, never across a copy, a
//! transfer, a round trip, a connect or a fence; stores waiting for an adoption and
//! heartbeats waiting for publishes wait on its condition, each until its deadline.
//! The movers' own locks are leaves (`cxl`'s mappings; an agent's control
//! connection, taken by one caller at a time and never while the core is locked).
pub(crate) mod core;
#[cfg(test)]
mod core_tests;
mod held;
mod in_place;
mod load;
pub(crate) mod peers;
pub mod session;
mod store;

pub use self::core::PoolStats;
use self::core::{BeatCheck, CoreCell, Gone, PoolCore};
use super::clock::Deadline;
use super::error::WorkerError;
use super::movers::Mover;
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
pub use in_place::{InPlacePage, InPlaceWrite};
use session::Session;
use std::sync::Arc;
use std::time::Duration;

/// A request's timeout unless `with_timeout` says otherwise (`timeout_ms`'s default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long opening a pool waits for its agents to prove the key (`greet_agents`).
const GREET_WAIT: Duration = Duration::from_secs(2);

/// Pages a handler's pool keeps allocated ahead (taken in the same `alloc` as the
/// pages a store needs), so that most stores need no `alloc` round trip of their own.
pub const SPARE_PAGES: usize = 32;

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
/// A test hook run between a store's copy and its publish (see `TestHooks`).
pub type BeforePublish = Box<dyn Fn(&StoragePool, &[PageGrant]) + Send + Sync>;
/// A test hook run before the mover adopts a region the session took (see
/// `TestHooks`).
pub type BeforeAdopt = Box<dyn Fn(&RegionGrant) + Send + Sync>;
/// A test hook that sees each chunk written (its page, whether its bytes are
/// complete) and answers whether they are (see `TestHooks`).
pub type AfterWrite = Box<dyn Fn(&PageGrant, bool) -> bool + Send + Sync>;

/// Faults and observation points a test puts into a pool (cargo feature
/// `test-hooks`; never set by the library itself).
#[derive(Default)]
pub struct TestHooks {
    /// Runs after a store's bytes were written into its pages and before they are
    /// published (a test makes a region vanish there).
    pub before_publish: Option<BeforePublish>,
    /// Runs when maru-server has answered an `expand` with a region, before the pool
    /// notes the answer and its mover adopts the region (a test makes that moment
    /// long there: maru-server may already hand the region's pages to other stores).
    pub before_adopt: Option<BeforeAdopt>,
    /// Sees each chunk a store wrote and says whether its bytes are complete (a test
    /// fails some writes, or notes the pages written).
    pub after_write: Option<AfterWrite>,
    /// Pretends a transfer of unknown outcome may still land (pages of failed writes
    /// are then kept out of use).
    pub unfenced: bool,
    /// While set, the tick finds the agent of every own region silent too long.
    pub silent: Option<Arc<std::sync::atomic::AtomicBool>>,
}

pub struct StoragePool {
    pub session: Session,
    /// The pool's state and rules, behind its one lock.
    core: Arc<CoreCell>,
    mover: Mover,
    max_batch: usize,
    /// A request's timeout (`timeout_ms`): its waits on agents (connects, calls,
    /// transfers, fences) end this long after it started (see `Deadline`).
    timeout: Duration,
    hooks: TestHooks,
}

impl StoragePool {
    pub fn open(session: Session, mover: Mover) -> Result<StoragePool, WorkerError> {
        let core = match &mover {
            Mover::Remote(m) => m.core(),
            Mover::Cxl(_) => Arc::new(CoreCell::new(PoolCore::new(session.page_size, None))),
        };
        {
            let mut c = core.lock();
            c.set_page_size(session.page_size);
            c.set_wants_lead(mover.wants_lead());
        }
        let max_batch = session.handshake.max_batch.max(1);
        let pool = StoragePool {
            session,
            core,
            mover,
            max_batch,
            timeout: DEFAULT_TIMEOUT,
            hooks: TestHooks::default(),
        };
        if let Err(e) = pool.start(pool.deadline()) {
            pool.session.close_failed_open(&e, pool.deadline());
            return Err(e);
        }
        Ok(pool)
    }

    /// Has the mover make a region the session took usable, with an INFO line when
    /// it did (the header promises one per region mapped and given back).
    pub(super) fn adopt_region(
        &self,
        grant: &RegionGrant,
        by: Deadline,
    ) -> Result<(), WorkerError> {
        self.mover.adopt(grant, by)?;
        let h = &grant.handle;
        match &grant.agent {
            None => log::info!(
                "pool {}: region {} mapped writable ({} bytes at offset {} of {}, {} pages)",
                self.session.url,
                h.region_id,
                h.length,
                h.offset,
                grant.pool.path,
                grant.pages
            ),
            Some(agent) => log::info!(
                "pool {}: region {} mapped at agent {agent} ({} bytes, {} pages)",
                self.session.url,
                h.region_id,
                h.length,
                grant.pages
            ),
        }
        Ok(())
    }

    /// Maps the session's first region, if it came with one, and tells maru-server
    /// its memory node's boot id.
    fn start(&self, by: Deadline) -> Result<(), WorkerError> {
        if let Some(r) = self.session.first_region.clone() {
            self.adopt_region(&r, by)?;
            self.core.lock().adopted(&r);
        }
        self.report_boots(by)
    }

    /// Bounds each request's waits on agents by `timeout` from its start (10 s by
    /// default, as `timeout_ms`).
    pub fn with_timeout(mut self, timeout: Duration) -> StoragePool {
        self.timeout = timeout;
        self
    }

    /// Keeps up to about `n` allocated pages for the next stores (see `SPARE_PAGES`):
    /// they count as used at maru-server until a store fills them or the pool closes.
    pub fn with_spare_pages(self, n: usize) -> StoragePool {
        self.core.lock().set_spare_target(n);
        self
    }

    /// Holds at most `max_bytes` of regions (whole regions, at least one; 0: no
    /// limit): past it, stores evict the session's own keys instead of expanding.
    pub fn with_max_bytes(self, max_bytes: u64) -> StoragePool {
        let region = self.session.handshake.region_size.max(1);
        let max = (max_bytes > 0).then(|| (max_bytes / region).max(1));
        self.core.lock().set_max_regions(max);
        self
    }

    /// Test hooks (see [`TestHooks`]).
    #[cfg(feature = "test-hooks")]
    pub fn with_test_hooks(mut self, hooks: TestHooks) -> StoragePool {
        self.hooks = hooks;
        self
    }

    /// Test hook: `f(pool, pages)` runs after a store's bytes were written into
    /// `pages` and before they are published.
    #[cfg(feature = "test-hooks")]
    pub fn with_before_publish(mut self, f: BeforePublish) -> StoragePool {
        self.hooks.before_publish = Some(f);
        self
    }

    /// Test hook: `f(grant)` runs before the mover adopts each region the session
    /// takes after the pool opened.
    #[cfg(feature = "test-hooks")]
    pub fn with_before_adopt(mut self, f: BeforeAdopt) -> StoragePool {
        self.hooks.before_adopt = Some(f);
        self
    }

    /// Connects to the pool's agents (`remote_cxl`), so that an agent key that does
    /// not prove fails the open ([`WorkerError::Auth`]) rather than the first store.
    /// All of them within [`GREET_WAIT`] (or the timeout, if shorter): an agent that
    /// does not answer delays no open for long, and is connected when needed.
    pub(crate) fn greet_agents(&self) -> Result<(), WorkerError> {
        let by = Deadline::after(self.timeout.min(GREET_WAIT));
        self.mover.greet(&self.session.handshake.agents, by)
    }

    /// The deadline of a request starting now.
    fn deadline(&self) -> Deadline {
        Deadline::after(self.timeout)
    }

    /// Tells maru-server the boot ids of the own regions (a heartbeat) when it must
    /// hear them before anything else is published (a new region, or a memory node
    /// that rebooted: maru-server then drops that region's keys).
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
    pub fn pin(&self, keys: &[String], pin: bool) -> Result<Vec<bool>, WorkerError> {
        if pin {
            self.per_batch(keys, |s, k, by| s.pin(k, by))
        } else {
            self.per_batch(keys, |s, k, by| s.unpin(k, by))
        }
    }

    /// Unpublishes keys this session stored (see `RemoveResult` for the others).
    pub fn remove(
        &self,
        keys: &[String],
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        self.per_batch(keys, |s, k, by| s.remove(k, by))
    }

    pub fn exists(&self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        if self.session.away() {
            // maru-server did not answer a call by its deadline: false at once.
            return Ok(vec![false; keys.len()]);
        }
        self.per_batch(keys, |s, k, by| s.exists(k, by))
    }

    /// One session call per `max_batch` keys, the answers in order, all by one
    /// request deadline.
    fn per_batch<T>(
        &self,
        keys: &[String],
        call: impl Fn(&Session, &[String], Deadline) -> Result<Vec<T>, WorkerError>,
    ) -> Result<Vec<T>, WorkerError> {
        let by = self.deadline();
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(call(&self.session, chunk, by)?);
        }
        Ok(out)
    }

    /// Heartbeat: tells maru-server the own regions and their boot ids; regions it no
    /// longer counts as the session's are lost, regions it asks for are given back (now,
    /// or by their last writer). A report of a reboot waits (until a request's
    /// timeout) for the publishes re-checked before the reboot was found: maru-server
    /// drops their keys with the others. No lock is held across the round trip.
    ///
    /// Every wait of it (publishes a reboot's report waits for, the round trip) by
    /// `by`: the request's deadline (a store's re-check, a load that found a reboot),
    /// or the handler's for its heartbeat thread and a close.
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
    /// into: the mover forgets them; a region maru-server asked for is returned (its
    /// keys go, maru-server releases it at its agent before the RM frees it).
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

    /// Between ticks (every `lifecycle::AWAY_PROBE_EVERY_MS`): the mover probes the
    /// agents that are away, so that one answering again serves the next store.
    /// maru-server too, when it is away (an `exists` of no key, 1 s at most).
    pub fn probe_away(&self, now_ms: u64, by: Deadline) {
        self.mover.probe_away(now_ms, by);
        if self.session.away() {
            if let Err(e) = self.session.ping(by) {
                log::debug!("pool {}: maru-server still away: {e}", self.session.url);
            }
        }
    }

    /// Periodic work (about once a second): the mover probes the agents of own
    /// regions (without any pool lock: a probe of an agent slow to answer holds no
    /// request); regions whose agent stayed silent too long go back to maru-server
    /// once no publish into them is in flight (their keys go at once; its keeper
    /// releases them at the agent); a reboot found is reported.
    pub fn tick(&self, now_ms: u64, by: Deadline) -> Result<(), WorkerError> {
        let mut silent = self.mover.tick(now_ms);
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
        let spare = self.core.lock().drain_spare();
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
