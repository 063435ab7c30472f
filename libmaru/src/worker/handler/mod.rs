//! The handler an engine opens: the public calls ([`Handler`]), its pools (one per
//! maru-server URL, picked in `pools`), the staging buffer and transport
//! (`data_path`), and its background threads (`background`; `maru-release`, which
//! sends the pools' `ReleaseQueue`; `maru-ahead`, which takes the regions of its
//! `AheadQueue`).

mod background;
mod data_path;
mod in_place;
mod pools;
mod slot_ops;

use super::config::{BackendKind, HandlerConfig};
use super::error::{Peer, WorkerError};
use super::hook::Registration;
use super::key::Key;
use super::op_stats::OpStats;
use super::ops::{Executor, OpHandle, OpOutput};
use super::pool::{AheadQueue, PoolStats, Release, ReleaseQueue, StoragePool};
use super::router::PoolRouter;
use super::slots::{SlotInfo, SlotTable};
use super::staging::{Slot, SlotPool, StagingLayout, StagingSlots};
use super::views::{ViewInfo, ViewTable};
use super::warn_limit;
use crate::net::ClientOptions;
use crate::transport::Transport;
use crate::worker::clock::Deadline;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use in_place::{InPlaceInfo, RegionInfo};

/// The staging buffer (both backends: the slot API uses it) and, for remote_cxl, the
/// transport it is registered with; made once the slot size is known.
struct DataPath {
    /// Declared first: unregistered before the buffer can go.
    hook: Mutex<Option<Registration>>,
    staging: StagingSlots,
    nic: Option<Arc<dyn Transport>>,
    agent_opts: ClientOptions,
    /// Bytes in flight of the windowed transfers through this staging buffer.
    budget: Arc<super::movers::remote::InFlightBudget>,
}

/// A submitted slot operation, run with the slots lent to it.
type LentJob = Box<dyn FnOnce(Vec<Option<Slot>>) -> Result<OpOutput, WorkerError> + Send>;

/// The outcome of loading one chunk into a caller's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loaded {
    Miss,
    /// Loaded, this many bytes.
    Bytes(usize),
    /// Found, but larger than the buffer (this many bytes): nothing was copied.
    TooSmall(usize),
}

struct Inner {
    cfg: HandlerConfig,
    client_id: String,
    urls: Vec<String>,
    router: Mutex<PoolRouter>,
    /// Per pool, shared by its requests (the slot's lock held to take a reference).
    pools: Vec<Mutex<Option<Arc<StoragePool>>>>,
    /// Per pool: the session it lost, until it has a new one (see `set_aside`).
    lost: Vec<Mutex<Option<Arc<StoragePool>>>>,
    data: Mutex<Option<Arc<DataPath>>>,
    slots: Mutex<SlotTable>,
    views: Mutex<ViewTable>,
    /// Pages taken for writing in place, and region views (see `in_place`).
    in_place: Mutex<in_place::InPlaceTable>,
    region_views: Mutex<in_place::RegionViews>,
    executor: Executor,
    /// A transport given by the caller instead of the configured one (tests).
    transport: Option<Arc<dyn Transport>>,
    stop: AtomicBool,
    wake: (Mutex<()>, Condvar),
    /// Calls by kind: results, chunks, durations (`stats()["ops"]`).
    ops: OpStats,
    /// Stores skipped because their pool was unavailable (the pools count the others).
    skips: Mutex<crate::worker::skips::SkipLog>,
    /// The memory hook in force when the handler opened.
    hook: crate::worker::MemoryHook,
    /// Leases whose release waits for the `maru-release` thread (`maru_load_pieces`).
    releases: ReleaseQueue,
    /// Pools whose next region the `maru-ahead` thread takes ahead of need.
    ahead: AheadQueue,
}

/// A request goes to the pool its route key picks (`router`); one that cannot be
/// reached answers `miss` (see `pools`).
impl Inner {
    /// Runs `f` on the request's pool; an unavailable pool is set aside for the
    /// background thread to reconnect, and the call answers `miss`.
    pub(super) fn with_pool<T>(
        &self,
        route_key: &str,
        miss: T,
        f: impl FnOnce(&Arc<StoragePool>) -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(WorkerError::Closed);
        }
        let i = self
            .router
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .pick(route_key);
        let pool = {
            let slot = self.pools[i].lock().map_err(|_| WorkerError::Closed)?;
            match slot.as_ref() {
                Some(p) => p.clone(),
                None => {
                    if let Some(n) = warn_limit::allow(&self.urls[i], "unavailable") {
                        log::warn!(
                            "pool {} is unavailable: the loads routed to it miss and the stores are skipped until a session opens again{}",
                            self.urls[i],
                            warn_limit::held_back(n)
                        );
                    }
                    return Ok(miss);
                }
            }
        };
        let r = f(&pool);
        self.ahead.note(&pool);
        match r {
            Err(e) => self.pool_failed(i, &pool, e, miss),
            r => r,
        }
    }

    /// As `with_pool` for a store of `n` chunks: when the pool is unavailable (set
    /// aside, or lost during the call) the chunks are skipped, counted under
    /// `pool_unavailable`, and a WARN says so (once per reason per interval).
    pub(super) fn store_on_pool(
        &self,
        route_key: &str,
        n: usize,
        f: impl FnOnce(&StoragePool) -> Result<Vec<bool>, WorkerError>,
    ) -> Result<Vec<bool>, WorkerError> {
        let mut reached = false;
        let r = self.with_pool(route_key, vec![false; n], |p| {
            let r = f(p);
            reached = r.is_ok();
            r
        });
        if r.is_ok() && !reached {
            let i = self.router.lock().map(|r| r.pick(route_key)).unwrap_or(0);
            let what = format!("pool {}", self.urls.get(i).map_or("?", |u| u.as_str()));
            let line = self.skips.lock().ok().and_then(|mut s| {
                s.note(
                    crate::worker::skips::SkipReason::PoolUnavailable,
                    n as u64,
                    crate::worker::clock::now_ms(),
                    &what,
                )
            });
            if let Some(line) = line {
                log::warn!("{line}");
            }
        }
        r
    }

    pub(super) fn load<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
        sink: &mut crate::worker::movers::ReadSink<'_>,
        release_after: bool,
    ) -> Result<(), WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(());
        };
        let rk = route_key.unwrap_or(first.as_ref());
        let release = match release_after {
            true => Release::After(&self.releases),
            false => Release::Now,
        };
        if self.cfg.backend == BackendKind::Cxl {
            return self.with_pool(rk, (), |p| Self::load_in_place(p, keys, sink, release));
        }
        self.with_pool(rk, (), |p| p.load(keys, sink, release))
    }

    /// `cxl` loads: leases and views, then the copies out of the shared mapping with
    /// no lock held (each view keeps its mapping, each lease its page), then the
    /// release, by the same session, as `release` says.
    fn load_in_place<K: Key>(
        p: &Arc<StoragePool>,
        keys: &[K],
        sink: &mut crate::worker::movers::ReadSink<'_>,
        release: Release<'_>,
    ) -> Result<(), WorkerError> {
        // One deadline for the request's calls: the leases, and their release.
        let by = p.deadline();
        let got = p.acquire_views(keys, by)?;
        let mut leases = Vec::with_capacity(got.len());
        for (i, g) in got.iter().enumerate() {
            if let Some((lease, view)) = g {
                sink(i, view.bytes());
                leases.push(lease.lease_id);
            }
        }
        p.release(leases, by, release);
        Ok(())
    }
}

/// An open handler. Thread-safe; calls run in parallel, also on one pool.
pub struct Handler {
    inner: Arc<Inner>,
    /// The heartbeat, tick, release and ahead threads (see `background`,
    /// `ReleaseQueue`, `AheadQueue`).
    background: Mutex<Vec<JoinHandle<()>>>,
}

impl Handler {
    /// Opens a handler from its JSON configuration. A configuration error fails at
    /// once; a pool that cannot be reached is retried in the background (at least one
    /// must answer now, so that a wrong address is not mistaken for a pool that is down).
    pub fn open(config_json: &str) -> Result<Handler, WorkerError> {
        Handler::open_inner(config_json, None)
    }

    /// Opens a `remote_cxl` handler over the given transport instead of the configured
    /// one (fault injection in tests; cargo feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    pub fn open_with_transport(
        config_json: &str,
        transport: Arc<dyn Transport>,
    ) -> Result<Handler, WorkerError> {
        Handler::open_inner(config_json, Some(transport))
    }

    #[allow(clippy::disallowed_methods)] // a driver: starts the background thread
    fn open_inner(
        config_json: &str,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<Handler, WorkerError> {
        let cfg = HandlerConfig::parse(config_json).map_err(WorkerError::Config)?;
        let urls = cfg.server_urls().map_err(WorkerError::Config)?;
        let client_id = format!("{}@{}", cfg.engine_id, crate::net::default_client_id(""));
        let cfg_threads = cfg.async_threads;
        let inner = Arc::new(Inner {
            router: Mutex::new(PoolRouter::new(urls.clone())),
            pools: urls.iter().map(|_| Mutex::new(None)).collect(),
            lost: urls.iter().map(|_| Mutex::new(None)).collect(),
            urls,
            cfg,
            client_id,
            data: Mutex::new(None),
            slots: Mutex::new(SlotTable::default()),
            views: Mutex::new(ViewTable::default()),
            in_place: Mutex::default(),
            region_views: Mutex::default(),
            executor: Executor::new(cfg_threads),
            transport,
            stop: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            ops: OpStats::default(),
            skips: Mutex::default(),
            hook: crate::worker::hook::memory_hook(),
            releases: ReleaseQueue::default(),
            ahead: AheadQueue::default(),
        });
        let mut failed = Vec::new();
        let mut opened = 0;
        for i in 0..inner.pools.len() {
            match inner.open_pool(i) {
                Ok(p) => {
                    if let Ok(mut g) = inner.pools[i].lock() {
                        *g = Some(Arc::new(p));
                    }
                    opened += 1;
                }
                // A wrong configuration or key: the caller must fix it. The pools
                // opened already close again (a failed open leaves no session).
                Err(e) if e.is_fatal() => {
                    Handler::abandon(inner);
                    return Err(e);
                }
                Err(e) => failed.push((i, e)),
            }
        }
        if opened == 0 {
            // Nothing retries: the open fails with the last pool's error.
            Handler::abandon(inner);
            return Err(failed
                .pop()
                .map(|(_, e)| e)
                .unwrap_or_else(|| WorkerError::Config("server_url names no maru-server".into())));
        }
        for (i, e) in failed {
            log::warn!(
                "pool {} is unavailable at open: {e}; retrying in the background (its prefixes miss until then)",
                inner.urls[i]
            );
            inner.set_up(i, false);
        }
        let mut background = Vec::new();
        let jobs = [
            ("maru-handler", 0),
            ("maru-tick", 1),
            ("maru-release", 2),
            ("maru-ahead", 3),
        ];
        for (name, job) in jobs {
            let bg = inner.clone();
            let spawned = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || match job {
                    0 => bg.heartbeats(),
                    1 => bg.ticks(),
                    2 => bg.releases.send(bg.timeout()),
                    _ => bg.ahead.take(),
                });
            match spawned {
                Ok(h) => background.push(h),
                Err(e) => {
                    // Closing joins the threads started already and the sessions.
                    drop(Handler {
                        inner,
                        background: Mutex::new(background),
                    });
                    return Err(WorkerError::unavailable(
                        Peer::Host,
                        format!("cannot start the handler's {name} thread: {e}"),
                    ));
                }
            }
        }
        log::info!(
            "handler of engine {}: opened ({:?}, {opened} of {} pool(s) available)",
            inner.cfg.engine_id,
            inner.cfg.backend,
            inner.urls.len()
        );
        Ok(Handler {
            inner,
            background: Mutex::new(background),
        })
    }

    /// Ends what a failed open made: the sessions of the pools opened already, the
    /// staging buffer's memory-hook registration.
    fn abandon(inner: Arc<Inner>) {
        let h = Handler {
            inner,
            background: Mutex::new(Vec::new()),
        };
        if let Err(e) = h.close() {
            log::warn!("closing what a failed open made: {e}");
        }
    }

    /// Stores one chunk under `key`. Returns false when it was skipped (no staging slot,
    /// pool unavailable); true when stored now or already present.
    pub fn store(
        &self,
        key: &str,
        data: &[u8],
        route_key: Option<&str>,
    ) -> Result<bool, WorkerError> {
        Ok(self
            .store_batch(&[(key, data)], route_key)?
            .first()
            .copied()
            .unwrap_or(false))
    }

    /// Stores the chunks of one request (`route_key`: its first chunk key by default).
    pub fn store_batch(
        &self,
        items: &[(&str, &[u8])],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let Some(first) = items.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first.0);
        self.timed("store", items.len(), || {
            self.inner
                .store_on_pool(rk, items.len(), |p| p.store(items, Some(rk)))
        })
    }

    /// Runs one call of kind `op` naming `items` chunks and counts it (result and
    /// duration) in `stats()["ops"]`.
    fn timed<T>(
        &self,
        op: &'static str,
        items: usize,
        f: impl FnOnce() -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        let t0 = super::clock::now_us();
        let c0 = super::op_stats::contacts();
        let r = f();
        let took = super::clock::now_us().saturating_sub(t0);
        let c1 = super::op_stats::contacts();
        let contacts = (c1.0 - c0.0, c1.1 - c0.1);
        self.inner.ops.record(op, r.is_ok(), items, took, contacts);
        match &r {
            Ok(_) => log::debug!("{op} of {items} chunk(s): done in {took} us"),
            Err(e) => log::debug!("{op} of {items} chunk(s): failed in {took} us: {e}"),
        }
        r
    }

    pub fn load(&self, key: &str, route_key: Option<&str>) -> Result<Option<Vec<u8>>, WorkerError> {
        Ok(self.load_batch(&[key], route_key)?.pop().flatten())
    }

    /// Loads the chunks of one request and hands each found one to `f(index, bytes)`
    /// where it lies (`cxl`: the shared mapping; `remote_cxl`: the staging slot), valid
    /// only during the call of `f` (which runs with no lock held). With
    /// `release_after`, the leases are given back after the call, by the handler's
    /// `maru-release` thread (see `ReleaseQueue`): for a caller that copies the bytes
    /// out inside `f` (`maru_load_pieces`).
    pub fn load_each<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
        release_after: bool,
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), WorkerError> {
        self.timed("load", keys.len(), || {
            self.inner.load(keys, route_key, f, release_after)
        })
    }

    /// Releases queued for the `maru-release` thread now (tests, `stats`).
    pub fn releases_queued(&self) -> usize {
        self.inner.releases.len()
    }

    /// Loads the chunks of one request into new vectors (`None`: miss or failed read).
    pub fn load_batch<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
    ) -> Result<Vec<Option<Vec<u8>>>, WorkerError> {
        let mut out = vec![None; keys.len()];
        self.load_each(keys, route_key, false, &mut |i, b| {
            let mut v = vec![0u8; b.len()];
            crate::dax::copy::copy_out(&mut v, b);
            out[i] = Some(v)
        })?;
        Ok(out)
    }

    /// Loads the chunks of one request straight into the caller's buffers (one copy:
    /// from the staging slot on `remote_cxl`, from the shared mapping on `cxl`).
    pub fn load_into<K: Key>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
        route_key: Option<&str>,
    ) -> Result<Vec<Loaded>, WorkerError> {
        if bufs.len() != keys.len() {
            return Err(WorkerError::InvalidArgument(format!(
                "{} keys but {} buffers",
                keys.len(),
                bufs.len()
            )));
        }
        let mut out = vec![Loaded::Miss; keys.len()];
        self.load_each(keys, route_key, false, &mut |i, b| {
            let dst = &mut bufs[i];
            out[i] = if b.len() <= dst.len() {
                crate::dax::copy::copy_out(dst, b);
                Loaded::Bytes(b.len())
            } else {
                Loaded::TooSmall(b.len())
            };
        })?;
        Ok(out)
    }

    pub fn exists_batch<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first.as_ref());
        self.timed("exists", keys.len(), || {
            self.inner
                .with_pool(rk, vec![false; keys.len()], |p| p.exists(keys))
        })
    }

    /// Unpublishes keys this engine stored; per key: removed, not found, stored by
    /// another engine (refused), or leased by a reader now (refused). A pool that is
    /// unavailable answers `NotFound`.
    pub fn remove_batch<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first.as_ref());
        self.timed("remove", keys.len(), || {
            self.inner.with_pool(
                rk,
                vec![crate::wire::meta::RemoveResult::NotFound; keys.len()],
                |p| p.remove(keys),
            )
        })
    }

    /// Pins keys of one request (`pin`: neither evicted nor removed until unpinned, the
    /// handler closes or the region is lost), or drops one pin of each (`!pin`); per
    /// key: done. A pool that is unavailable answers `false`.
    pub fn pin_batch<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
        pin: bool,
    ) -> Result<Vec<bool>, WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first.as_ref());
        self.inner
            .with_pool(rk, vec![false; keys.len()], |p| p.pin(keys, pin))
    }

    // ------------------------------------------------------------ slot API

    /// Takes between 1 and `n` staging slots of `pool`, waiting up to `timeout` for at
    /// least one. The caller fills (store) or reads (load) them in place and releases
    /// them with [`Handler::release_slots`].
    pub fn acquire_slots(
        &self,
        pool: SlotPool,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<SlotInfo>, WorkerError> {
        if self.inner.stop.load(Ordering::SeqCst) {
            return Err(WorkerError::Closed);
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let got = self.inner.staging()?.acquire(pool, n, timeout);
        if got.is_empty() {
            return Err(WorkerError::NoSpace(format!(
                "no free {pool} staging slot within {} ms ({} configured): release slots or raise {pool}_slots",
                timeout.as_millis(),
                self.slots_configured(pool)
            )));
        }
        let mut t = self.inner.slot_table()?;
        Ok(got.into_iter().map(|s| t.insert(s)).collect())
    }

    /// The slots of `pool` this handler was configured with (0: none; asking for one
    /// fails at once).
    pub fn slots_configured(&self, pool: SlotPool) -> usize {
        match pool {
            SlotPool::Load => self.inner.cfg.load_slots,
            SlotPool::Store => self.inner.cfg.store_slots,
        }
    }

    /// Gives slots back. A slot lent to a running operation is refused (`Busy`).
    pub fn release_slots(&self, ids: &[u64]) -> Result<(), WorkerError> {
        self.inner.slot_table()?.release(ids)
    }

    /// Stores `lens[i]` bytes of slot `ids[i]` under `keys[i]` (no copy on
    /// `remote_cxl`). The slots stay the caller's, but one whose transfer outcome was
    /// unknown: libmaru keeps it (releasing its id is a no-op).
    pub fn store_slots<K: Key>(
        &self,
        keys: &[K],
        ids: &[u64],
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        self.timed("store_slots", keys.len(), || {
            let lent = self.inner.lend(ids)?;
            self.inner.store_slots(keys, ids, lent, lens, route_key)
        })
    }

    /// Loads chunk `keys[i]` into slot `ids[i]` (the READ lands in the slot); `Some(len)`
    /// where it was loaded. The slots stay the caller's, as for `store_slots`.
    pub fn load_slots<K: Key>(
        &self,
        keys: &[K],
        ids: &[u64],
        route_key: Option<&str>,
    ) -> Result<Vec<Option<usize>>, WorkerError> {
        self.timed("load_slots", keys.len(), || {
            let lent = self.inner.lend(ids)?;
            self.inner.load_slots(keys, ids, lent, route_key)
        })
    }

    /// `store_slots` on an executor thread. The slots are lent to the operation until
    /// it finishes.
    pub fn submit_store_slots(
        &self,
        keys: Vec<String>,
        ids: Vec<u64>,
        lens: Vec<usize>,
        route_key: Option<String>,
    ) -> Result<OpHandle, WorkerError> {
        self.submit_lent(ids, move |inner, ids, lent| {
            inner
                .store_slots(&keys, ids, lent, &lens, route_key.as_deref())
                .map(OpOutput::Stored)
        })
    }

    /// `load_slots` on an executor thread.
    pub fn submit_load_slots(
        &self,
        keys: Vec<String>,
        ids: Vec<u64>,
        route_key: Option<String>,
    ) -> Result<OpHandle, WorkerError> {
        self.submit_lent(ids, move |inner, ids, lent| {
            inner
                .load_slots(&keys, ids, lent, route_key.as_deref())
                .map(OpOutput::Loaded)
        })
    }

    /// Lends the slots now and runs `f` with them on an executor thread.
    fn submit_lent(
        &self,
        ids: Vec<u64>,
        f: impl FnOnce(&Inner, &[u64], Vec<Option<Slot>>) -> Result<OpOutput, WorkerError>
            + Send
            + 'static,
    ) -> Result<OpHandle, WorkerError> {
        let inner = self.inner.clone();
        let lent = self.inner.lend(&ids)?;
        let back = ids.clone();
        self.inner
            .submit(&back, lent, Box::new(move |lent| f(&inner, &ids, lent)))
    }

    // ------------------------------------------------------------ views (cxl)

    /// Views of chunks in place (`cxl` only: this host's read-only mapping), each under
    /// a lease until [`Handler::release_views`], for at most `valid_ms`.
    pub fn acquire_views<K: Key>(
        &self,
        keys: &[K],
        route_key: Option<&str>,
    ) -> Result<Vec<Option<ViewInfo>>, WorkerError> {
        if self.inner.cfg.backend != BackendKind::Cxl {
            return Err(WorkerError::InvalidArgument(
                "views of the shared mapping need backend cxl; on remote_cxl load into staging slots (maru_load_slots)".into(),
            ));
        }
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first.as_ref());
        let got = self.timed("views", keys.len(), || {
            self.inner.with_pool(rk, vec![None; keys.len()], |p| {
                p.acquire_views(keys, Deadline::after(self.inner.timeout()))
            })
        })?;
        let mut t = self.inner.views.lock().map_err(|_| WorkerError::Closed)?;
        Ok(got
            .into_iter()
            .map(|g| g.map(|(lease, view)| t.insert(rk, lease.lease_id, lease.expires_in_ms, view)))
            .collect())
    }

    /// Ends views (and their leases). Unknown ids (already released) are ignored.
    pub fn release_views(&self, ids: &[u64]) -> Result<(), WorkerError> {
        let held = self
            .inner
            .views
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .take(ids);
        let mut by_route: std::collections::BTreeMap<&str, Vec<u64>> = Default::default();
        for h in &held {
            by_route.entry(&h.route).or_default().push(h.lease_id);
        }
        let by = Deadline::after(self.inner.timeout());
        for (route, ids) in by_route {
            let _ = self.inner.with_pool(route, (), |p| {
                p.release_leases(ids, by);
                Ok(())
            });
        }
        // The views (and their mappings) go once their leases are released.
        drop(held);
        Ok(())
    }

    /// Views the caller holds now.
    pub fn held_views(&self) -> usize {
        self.inner.views.lock().map(|t| t.held()).unwrap_or(0)
    }

    /// Whether each slot id is still the caller's (held, possibly lent to a running
    /// operation); false once released or taken back after a transfer whose outcome
    /// was unknown.
    pub fn slots_held(&self, ids: &[u64]) -> Result<Vec<bool>, WorkerError> {
        let t = self.inner.slot_table()?;
        Ok(ids.iter().map(|id| t.contains(*id)).collect())
    }

    /// Slots the caller holds now.
    pub fn held_slots(&self) -> usize {
        self.inner.slot_table().map(|t| t.held()).unwrap_or(0)
    }

    /// The staging buffer (its address, and how it is cut into slots: the load slots
    /// first, then the store slots), for a caller that hands its slots out as pages.
    pub fn staging_buffer(&self) -> Result<(*mut u8, StagingLayout), WorkerError> {
        let st = self.inner.staging()?;
        Ok((st.buffer().0, st.layout()))
    }

    /// The page (chunk) size of the pools.
    pub fn chunk_size(&self) -> Option<u64> {
        self.inner.pools.iter().find_map(|p| {
            p.lock()
                .ok()
                .and_then(|g| g.as_ref().map(|p| p.page_size()))
        })
    }

    /// Counters per pool and total, as JSON.
    pub fn stats(&self) -> serde_json::Value {
        let mut pools = Vec::new();
        let mut total = PoolStats::default();
        for (i, p) in self.inner.pools.iter().enumerate() {
            let pool = p.lock().ok().and_then(|g| g.clone());
            // Which session of which run of maru-server serves the pool now.
            let session = pool.as_ref().map(|p| p.session.id);
            let instance = pool.as_ref().map(|p| p.session.handshake.instance.clone());
            let s = pool.map(|p| p.stats());
            if let Some(s) = &s {
                total.add(s);
            }
            pools.push(
                serde_json::json!({"url": self.inner.urls[i], "up": s.is_some(), "session": session, "instance": instance, "stats": s}),
            );
        }
        if let Ok(sk) = self.inner.skips.lock() {
            total.skipped.add(&sk.counts);
        }
        let staging = self.inner.staging().ok().map(|st| {
            let l = st.layout();
            serde_json::json!({
                "slot_size": l.slot_size,
                "load_slots": l.load_slots,
                "store_slots": l.store_slots,
                "free_load_slots": st.free(SlotPool::Load),
                "free_store_slots": st.free(SlotPool::Store),
                "held_by_caller": self.held_slots(),
            })
        });
        let backend = match self.inner.cfg.backend {
            BackendKind::Cxl => "cxl",
            BackendKind::RemoteCxl => "remote_cxl",
        };
        serde_json::json!({"backend": backend, "engine_id": self.inner.cfg.engine_id, "pools": pools, "total": total, "staging": staging, "ops": self.inner.ops.snapshot()})
    }

    /// Closes every session (drained: regions with keys go to maru-server's keeper),
    /// once the operations submitted before ran (waiting at most `timeout_ms`).
    pub fn close(&self) -> Result<(), WorkerError> {
        if self.inner.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let left = self.inner.executor.settle(self.inner.timeout());
        if left > 0 {
            log::warn!(
                "handler {}: {left} submitted operation(s) still queued or running after {} ms (timeout_ms) at close: they end with MARU_ERR_CLOSED",
                self.inner.cfg.engine_id,
                self.inner.cfg.timeout_ms
            );
        }
        {
            let _g = self.inner.wake.0.lock();
            if self.inner.stop.swap(true, Ordering::SeqCst) {
                return Ok(());
            }
            self.inner.wake.1.notify_all();
        }
        // The release thread sends what is queued, then ends (joined below, before
        // the sessions close); the ahead thread ends without taking a region.
        self.inner.releases.close();
        self.inner.ahead.close();
        let threads = self
            .background
            .lock()
            .map(|mut b| std::mem::take(&mut *b))
            .unwrap_or_default();
        for h in threads {
            let _ = h.join();
        }
        // Operations already running finish; queued ones fail with `Closed`.
        self.inner.executor.shutdown();
        let mut first_err = None;
        for (i, p) in self.inner.pools.iter().enumerate() {
            // Requests still running on it hold their own reference; they fail once
            // the session is closed.
            let taken = p.lock().ok().and_then(|mut g| g.take());
            if let Some(pool) = taken {
                if let Err(e) = pool.close(Deadline::after(self.inner.timeout())) {
                    log::warn!("pool {}: close failed: {e}", self.inner.urls[i]);
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Ok(mut t) = self.inner.slots.lock() {
            t.clear();
        }
        self.close_in_place();
        // The sessions are closed: their leases ended with them; the views' mappings go.
        if let Ok(mut t) = self.inner.views.lock() {
            drop(t.clear());
        }
        // Every user of the staging buffer is gone: unregister it from the memory hook.
        if let Some(dp) = self.inner.data.lock().ok().and_then(|mut d| d.take()) {
            if let Ok(mut h) = dp.hook.lock() {
                if let Some(mut reg) = h.take() {
                    reg.release();
                }
            }
        }
        match &first_err {
            None => log::info!(
                "handler of engine {}: closed (its sessions ended; the keys it stored stay readable)",
                self.inner.cfg.engine_id
            ),
            Some(e) => log::warn!(
                "handler of engine {}: closed; a session did not close cleanly ({e}): maru-server ends it when its heartbeats stop",
                self.inner.cfg.engine_id
            ),
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
