//! The handler an engine opens: configuration, the pools (one per maru-server URL),
//! the shared staging buffer and transport, and a background thread that heartbeats
//! sessions and reconnects pools that went away (their prefixes miss meanwhile).

use super::config::{BackendKind, HandlerConfig, TransportKind};
use super::error::WorkerError;
use super::hook::Registration;
use super::movers::{CxlMover, Mover, RemoteMover};
use super::ops::{Executor, OpHandle, OpOutput};
use super::pool::{PoolStats, StoragePool};
use super::router::PoolRouter;
use super::session::Session;
use super::slots::{SlotInfo, SlotTable};
use super::staging::{Slot, SlotPool, StagingLayout, StagingSlots};
use super::views::{ViewInfo, ViewTable};
use crate::auth::SharedKey;
use crate::net::ClientOptions;
use crate::transport::soft::SoftTransport;
use crate::transport::{LocalBuffer, Transport};
use crate::wire::meta::Backend;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The staging buffer (both backends: the slot API uses it) and, for remote_cxl, the
/// transport it is registered with; made once the slot size is known.
struct DataPath {
    /// Declared first: unregistered before the buffer can go.
    hook: Mutex<Option<Registration>>,
    staging: StagingSlots,
    nic: Option<Arc<dyn Transport>>,
    agent_opts: ClientOptions,
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
    pools: Vec<Mutex<Option<StoragePool>>>,
    /// Per pool: the session it lost, until it has a new one (see `set_aside`).
    lost: Vec<Mutex<Option<StoragePool>>>,
    data: Mutex<Option<Arc<DataPath>>>,
    slots: Mutex<SlotTable>,
    views: Mutex<ViewTable>,
    executor: Executor,
    /// A transport given by the caller instead of the configured one (tests).
    transport: Option<Arc<dyn Transport>>,
    stop: AtomicBool,
    wake: (Mutex<()>, Condvar),
}

/// An open handler. Thread-safe; calls on different pools run in parallel.
pub struct Handler {
    inner: Arc<Inner>,
    background: Mutex<Option<JoinHandle<()>>>,
}

fn agent_key(cfg: &HandlerConfig) -> Result<SharedKey, WorkerError> {
    let path = match &cfg.agent_key_file {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/root"))
            .join(".maru/remote-cxl-agent.key"),
    };
    crate::auth::load_key_file(&path).map_err(|e| WorkerError::Config(format!("agent key: {e}")))
}

fn make_transport(
    cfg: &HandlerConfig,
    client_id: &str,
    key: &SharedKey,
) -> Result<Arc<dyn Transport>, WorkerError> {
    match cfg.transport.unwrap_or(TransportKind::Soft) {
        TransportKind::Soft => Ok(Arc::new(SoftTransport::new(
            client_id.to_string(),
            Some(key.clone()),
        ))),
        TransportKind::Verbs => verbs_transport(cfg),
    }
}

#[cfg(feature = "verbs")]
fn verbs_transport(cfg: &HandlerConfig) -> Result<Arc<dyn Transport>, WorkerError> {
    let settings = crate::transport::verbs::VerbsSettings {
        device: cfg.rdma_device.clone(),
        port: cfg.rdma_port,
        gid_index: cfg.rdma_gid_index,
        traffic_class: cfg.rdma_traffic_class,
        service_level: cfg.rdma_service_level,
    };
    crate::transport::verbs::VerbsTransport::open_with(&settings)
        .map(|t| Arc::new(t) as Arc<dyn Transport>)
        .map_err(|e| WorkerError::Config(e.to_string()))
}

#[cfg(not(feature = "verbs"))]
fn verbs_transport(_cfg: &HandlerConfig) -> Result<Arc<dyn Transport>, WorkerError> {
    Err(WorkerError::Config("transport verbs: this libmaru was built without the verbs feature; use transport soft or rebuild with --features verbs".into()))
}

impl Inner {
    fn backend(&self) -> Backend {
        match self.cfg.backend {
            BackendKind::Cxl => Backend::Cxl,
            BackendKind::RemoteCxl => Backend::RemoteCxl,
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.timeout_ms)
    }

    /// The data path, created from the first session's page size.
    fn data_path(&self, page_size: u64) -> Result<Arc<DataPath>, WorkerError> {
        let mut d = self.data.lock().map_err(|_| WorkerError::Closed)?;
        if let Some(dp) = d.as_ref() {
            if (dp.staging.layout().slot_size as u64) < page_size {
                return Err(WorkerError::Config(format!(
                    "pools have different page sizes ({} and {page_size}); give every maru-server of a handler the same --chunk-size",
                    dp.staging.layout().slot_size
                )));
            }
            return Ok(dp.clone());
        }
        let layout = StagingLayout {
            slot_size: page_size as usize,
            load_slots: self.cfg.load_slots,
            store_slots: self.cfg.store_slots,
        };
        layout
            .validate(page_size as usize, 1, 1)
            .map_err(WorkerError::Config)?;
        let staging = StagingSlots::new(layout).map_err(|e| {
            WorkerError::NoSpace(format!(
                "staging buffer of {} bytes: {e}",
                layout.total_bytes()
            ))
        })?;
        let (ptr, len) = staging.buffer();
        // Before the first transfer uses the buffer (and before the NIC registers it).
        let hook = super::hook::register(ptr, len)?;
        let mut agent_opts =
            ClientOptions::new(crate::wire::agent::SERVICE, self.client_id.clone());
        let nic = match self.cfg.backend {
            BackendKind::Cxl => None,
            BackendKind::RemoteCxl => {
                // Transfers land in it: resident from now on (cxl uses it only for
                // the slot API, whose callers fault in what they touch).
                staging.populate();
                let key = agent_key(&self.cfg)?;
                let nic = match &self.transport {
                    Some(t) => t.clone(),
                    None => make_transport(&self.cfg, &self.client_id, &key)?,
                };
                nic.register_local(LocalBuffer { ptr, len })
                    .map_err(|e| WorkerError::Config(e.to_string()))?;
                agent_opts.key = Some(key);
                Some(nic)
            }
        };
        agent_opts.call_timeout = self.timeout();
        agent_opts.connect_timeout = self.timeout().min(Duration::from_secs(5));
        let dp = Arc::new(DataPath {
            hook: Mutex::new(Some(hook)),
            staging,
            nic,
            agent_opts,
        });
        *d = Some(dp.clone());
        Ok(dp)
    }

    fn open_pool(&self, i: usize) -> Result<StoragePool, WorkerError> {
        let url = &self.urls[i];
        let mut session = Session::open(
            url,
            &self.client_id,
            &self.cfg.engine_id,
            &self.cfg.namespace,
            &self.cfg.layout,
            self.backend(),
            self.timeout(),
        )?;
        session.set_reply_spin(Duration::from_micros(self.cfg.reply_spin_us));
        let dp = self.data_path(session.page_size)?;
        let mover: Box<dyn Mover> = match &dp.nic {
            None => Box::new(CxlMover::with_prefault(self.cfg.prefault)),
            Some(nic) => Box::new(RemoteMover::new(
                nic.clone(),
                dp.staging.clone(),
                dp.agent_opts.clone(),
                self.timeout(),
            )),
        };
        Ok(StoragePool::open(session, mover)?.with_spare_pages(super::pool::SPARE_PAGES))
    }

    fn set_up(&self, i: usize, up: bool) {
        if let Ok(mut r) = self.router.lock() {
            if r.set_up(i, up) {
                if up {
                    log::info!("pool {} is available", self.urls[i]);
                } else {
                    log::warn!(
                        "pool {} is unavailable: its prefixes miss until it is back",
                        self.urls[i]
                    );
                }
            }
        }
    }

    /// Runs `f` on the request's pool; an unavailable pool is set aside for the
    /// background thread to reconnect, and the call answers `miss`.
    fn with_pool<T>(
        &self,
        route_key: &str,
        miss: T,
        f: impl FnOnce(&mut StoragePool) -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(WorkerError::Closed);
        }
        let i = self
            .router
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .pick(route_key);
        let mut slot = self.pools[i].lock().map_err(|_| WorkerError::Closed)?;
        let Some(pool) = slot.as_mut() else {
            return Ok(miss);
        };
        match f(pool) {
            // Unreachable, or our session is gone there (expired, unknown): set the pool
            // aside; the background thread opens a new session.
            Err(WorkerError::Unavailable(m)) | Err(WorkerError::Refused(m)) => {
                log::warn!("pool {}: {m}", self.urls[i]);
                let old = slot.take();
                drop(slot);
                self.set_aside(i, old);
                self.set_up(i, false);
                self.wake.1.notify_all();
                Ok(miss)
            }
            r => r,
        }
    }

    /// Keeps the session a pool lost until the pool has a new one: only then is it
    /// known whether maru-server restarted (its keeper is gone with it) or the old
    /// session merely expired or was out of reach (maru-server's keeper has its regions).
    fn set_aside(&self, i: usize, old: Option<StoragePool>) {
        if let (Some(old), Ok(mut l)) = (old, self.lost[i].lock()) {
            // A pool set aside twice before it came back: the older one goes now.
            *l = Some(old);
        }
    }

    /// The pool has a new session: if it comes from another run of maru-server, release
    /// the regions of the one set aside at their agents (no keeper will), else just let
    /// it go (the keeper takes its regions over when it expires).
    fn settle_set_aside(&self, i: usize, new: &StoragePool) {
        let Some(mut old) = self.lost[i].lock().ok().and_then(|mut l| l.take()) else {
            return;
        };
        let (was, now) = (
            old.session.handshake.instance.clone(),
            new.session.handshake.instance.clone(),
        );
        if !was.is_empty() && was != now {
            let (released, failed) = old.release_regions();
            log::warn!(
                "pool {}: maru-server restarted (instance {was} → {now}); released {released} region(s) of the lost session at their agents{}",
                self.urls[i],
                if failed > 0 {
                    format!(", {failed} could not be released (the agents' sweep deregisters them once the RM forgets them)")
                } else {
                    String::new()
                }
            );
        }
    }

    fn slot_table(&self) -> Result<std::sync::MutexGuard<'_, SlotTable>, WorkerError> {
        self.slots.lock().map_err(|_| WorkerError::Closed)
    }

    fn staging(&self) -> Result<StagingSlots, WorkerError> {
        self.data
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .as_ref()
            .map(|d| d.staging.clone())
            .ok_or_else(|| WorkerError::Unavailable("no pool has been reached yet".into()))
    }

    fn load(
        &self,
        keys: &[String],
        route_key: Option<&str>,
        sink: &mut super::movers::ReadSink<'_>,
    ) -> Result<(), WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(());
        };
        let rk = route_key.unwrap_or(first);
        if self.cfg.backend == BackendKind::Cxl {
            return self.load_in_place(keys, rk, sink);
        }
        self.with_pool(rk, (), |p| p.load(keys, sink))
    }

    /// `cxl` loads: leases and views under the pool's lock, the copies out of the
    /// shared mapping without it (each view keeps its mapping alive, each lease its
    /// page from reuse), the leases' release under the lock again. So threads sharing
    /// a handler copy side by side.
    fn load_in_place(
        &self,
        keys: &[String],
        rk: &str,
        sink: &mut super::movers::ReadSink<'_>,
    ) -> Result<(), WorkerError> {
        let got = self.with_pool(rk, vec![None; keys.len()], |p| p.acquire_views(keys))?;
        let mut leases = Vec::with_capacity(got.len());
        for (i, g) in got.iter().enumerate() {
            if let Some((lease, view)) = g {
                sink(i, view.bytes());
                leases.push(lease.lease_id);
            }
        }
        if !leases.is_empty() {
            self.with_pool(rk, (), |p| {
                p.release_leases(leases);
                Ok(())
            })?;
        }
        Ok(())
    }

    fn acquire_slots(
        &self,
        pool: SlotPool,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<SlotInfo>, WorkerError> {
        if self.stop.load(Ordering::SeqCst) {
            return Err(WorkerError::Closed);
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let got = self.staging()?.acquire(pool, n, timeout);
        if got.is_empty() {
            return Err(WorkerError::NoSpace(format!(
                "no free {pool} staging slot within {} ms ({} configured): release slots or raise {pool}_slots",
                timeout.as_millis(),
                match pool {
                    SlotPool::Load => self.cfg.load_slots,
                    SlotPool::Store => self.cfg.store_slots,
                }
            )));
        }
        let mut t = self.slot_table()?;
        Ok(got.into_iter().map(|s| t.insert(s)).collect())
    }

    /// Releases views' leases at their pools (per route), then drops the views.
    fn end_leases(&self, held: Vec<super::views::Held>) {
        let mut by_route: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
        for h in &held {
            by_route
                .entry(h.route.clone())
                .or_default()
                .push(h.lease_id);
        }
        for (route, ids) in by_route {
            let _ = self.with_pool(&route, (), |p| {
                p.release_leases(ids);
                Ok(())
            });
        }
        drop(held);
    }

    /// Marks the caller's slots busy and hands them over (at once, also for a submitted
    /// operation, so a release racing with it is refused rather than lost).
    fn lend(&self, ids: &[u64]) -> Result<Vec<Option<Slot>>, WorkerError> {
        self.slot_table()?.take(ids)
    }

    /// Runs `f` on lent slots and takes back whatever it hands back, also on error.
    fn with_lent<T>(
        &self,
        ids: &[u64],
        mut lent: Vec<Option<Slot>>,
        f: impl FnOnce(&mut [Option<Slot>]) -> Result<T, WorkerError>,
    ) -> Result<T, WorkerError> {
        let r = f(&mut lent);
        match self.slot_table() {
            Ok(mut t) => t.give_back(ids, lent),
            Err(_) => drop(lent),
        }
        r
    }

    fn store_slots(
        &self,
        keys: &[String],
        ids: &[u64],
        lent: Vec<Option<Slot>>,
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        // Every check inside: lent slots must go back to the table whatever happens.
        self.with_lent(ids, lent, |slots| {
            if keys.len() != ids.len() || keys.len() != lens.len() {
                return Err(WorkerError::InvalidArgument(format!(
                    "{} keys, {} slots and {} lengths: give one slot and length per key",
                    keys.len(),
                    ids.len(),
                    lens.len()
                )));
            }
            let Some(first) = keys.first() else {
                return Ok(Vec::new());
            };
            let rk = route_key.unwrap_or(first);
            for (i, s) in slots.iter().enumerate() {
                let cap = s.as_ref().map_or(0, |s| s.len());
                if lens[i] > cap {
                    return Err(WorkerError::InvalidArgument(format!(
                        "lens[{i}] = {} is larger than slot {} ({cap} bytes)",
                        lens[i], ids[i]
                    )));
                }
            }
            let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
            self.with_pool(rk, vec![false; keys.len()], |p| {
                p.store_slots(&ks, slots, lens, Some(rk))
            })
        })
    }

    fn load_slots(
        &self,
        keys: &[String],
        ids: &[u64],
        lent: Vec<Option<Slot>>,
        route_key: Option<&str>,
    ) -> Result<Vec<Option<usize>>, WorkerError> {
        self.with_lent(ids, lent, |slots| {
            if keys.len() != ids.len() {
                return Err(WorkerError::InvalidArgument(format!(
                    "{} keys but {} slots: give one slot per key",
                    keys.len(),
                    ids.len()
                )));
            }
            let Some(first) = keys.first() else {
                return Ok(Vec::new());
            };
            let rk = route_key.unwrap_or(first);
            self.with_pool(rk, vec![None; keys.len()], |p| p.load_slots(keys, slots))
        })
    }

    /// Queues `job` with the slots already lent to it; if it cannot be queued, the
    /// slots go back to the caller.
    fn submit(
        &self,
        ids: &[u64],
        lent: Vec<Option<Slot>>,
        job: LentJob,
    ) -> Result<OpHandle, WorkerError> {
        let give_back = |lent: Vec<Option<Slot>>| {
            if let Ok(mut t) = self.slot_table() {
                t.give_back(ids, lent);
            }
        };
        if self.stop.load(Ordering::SeqCst) {
            give_back(lent);
            return Err(WorkerError::Closed);
        }
        // The slots travel with the job; a job that is dropped unrun (queue closed)
        // drops them into their pool, and close clears the table anyway.
        let cell = Arc::new(Mutex::new(Some(lent)));
        let mine = cell.clone();
        let r = self.executor.submit(Box::new(move || {
            let lent = mine
                .lock()
                .ok()
                .and_then(|mut l| l.take())
                .unwrap_or_default();
            job(lent)
        }));
        if r.is_err() {
            if let Some(lent) = cell.lock().ok().and_then(|mut l| l.take()) {
                give_back(lent);
            }
        }
        r
    }

    fn background(self: &Arc<Self>) {
        // Heartbeat well within the shortest session timeout of the pools.
        let timeout_ms = self
            .pools
            .iter()
            .filter_map(|p| {
                p.lock()
                    .ok()
                    .and_then(|g| g.as_ref().map(|p| p.session.session_timeout_ms))
            })
            .min()
            .unwrap_or(30_000);
        let beat = Duration::from_millis((timeout_ms / 3).clamp(200, 10_000));
        let mut since_beat = Duration::ZERO;
        let tick = Duration::from_secs(1).min(beat);
        while !self.stop.load(Ordering::SeqCst) {
            let any_down = self
                .pools
                .iter()
                .any(|p| p.lock().map(|g| g.is_none()).unwrap_or(false));
            let wait = if any_down {
                tick
            } else {
                beat.saturating_sub(since_beat).max(tick)
            };
            if let Ok(g) = self.wake.0.lock() {
                // `stop` is set under this lock, so a close between the loop check and
                // here is seen before waiting.
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                let _ = self.wake.1.wait_timeout(g, wait);
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            since_beat += wait;
            for i in 0..self.pools.len() {
                let down = self.pools[i].lock().map(|g| g.is_none()).unwrap_or(false);
                if down {
                    match self.open_pool(i) {
                        Ok(p) => {
                            self.settle_set_aside(i, &p);
                            if let Ok(mut g) = self.pools[i].lock() {
                                *g = Some(p);
                            }
                            self.set_up(i, true);
                        }
                        Err(e) => log::debug!("pool {} still unavailable: {e}", self.urls[i]),
                    }
                } else if since_beat >= beat {
                    let mut g = match self.pools[i].lock() {
                        Ok(g) => g,
                        Err(_) => continue,
                    };
                    if let Some(p) = g.as_mut() {
                        if let Err(e) = p.heartbeat() {
                            log::warn!("pool {}: heartbeat failed: {e}", self.urls[i]);
                            if matches!(e, WorkerError::Unavailable(_) | WorkerError::Refused(_)) {
                                let old = g.take();
                                drop(g);
                                self.set_aside(i, old);
                                self.set_up(i, false);
                            }
                        }
                    }
                }
            }
            if since_beat >= beat {
                since_beat = Duration::ZERO;
            }
        }
    }
}

impl Handler {
    /// Opens a handler from its JSON configuration. A configuration error fails at
    /// once; a pool that cannot be reached is retried in the background (at least one
    /// must answer now, so that a wrong address is not mistaken for a pool that is down).
    pub fn open(config_json: &str) -> Result<Handler, WorkerError> {
        Handler::open_inner(config_json, None)
    }

    /// Opens a `remote_cxl` handler over the given transport instead of the configured
    /// one (fault injection in tests).
    #[doc(hidden)]
    pub fn open_with_transport(
        config_json: &str,
        transport: Arc<dyn Transport>,
    ) -> Result<Handler, WorkerError> {
        Handler::open_inner(config_json, Some(transport))
    }

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
            executor: Executor::new(cfg_threads),
            transport,
            stop: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
        });
        let mut last_err = None;
        let mut opened = 0;
        for i in 0..inner.pools.len() {
            match inner.open_pool(i) {
                Ok(p) => {
                    if let Ok(mut g) = inner.pools[i].lock() {
                        *g = Some(p);
                    }
                    opened += 1;
                }
                Err(e @ WorkerError::Config(_)) => return Err(e),
                Err(e) => {
                    log::warn!(
                        "pool {} is unavailable at open: {e}; retrying in the background",
                        inner.urls[i]
                    );
                    inner.set_up(i, false);
                    last_err = Some(e);
                }
            }
        }
        if opened == 0 {
            return Err(last_err.unwrap_or_else(|| WorkerError::Unavailable("no pool".into())));
        }
        let bg = inner.clone();
        let background = std::thread::Builder::new()
            .name("maru-handler".into())
            .spawn(move || bg.background())
            .map_err(|e| {
                WorkerError::Unavailable(format!("cannot start the handler thread: {e}"))
            })?;
        Ok(Handler {
            inner,
            background: Mutex::new(Some(background)),
        })
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
        self.inner
            .with_pool(rk, vec![false; items.len()], |p| p.store(items, Some(rk)))
    }

    pub fn load(&self, key: &str, route_key: Option<&str>) -> Result<Option<Vec<u8>>, WorkerError> {
        Ok(self
            .load_batch(&[key.to_string()], route_key)?
            .pop()
            .flatten())
    }

    /// Loads the chunks of one request and hands each found one to `f(index, bytes)`
    /// where it lies (`cxl`: the shared mapping; `remote_cxl`: the staging slot), with
    /// no copy by the library; the bytes are valid only during the call of `f`. On
    /// `cxl`, `f` runs without the pool's lock, so other threads of this handler go on.
    pub fn load_each(
        &self,
        keys: &[String],
        route_key: Option<&str>,
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), WorkerError> {
        self.inner.load(keys, route_key, f)
    }

    /// Loads the chunks of one request into new vectors (`None`: miss or failed read).
    pub fn load_batch(
        &self,
        keys: &[String],
        route_key: Option<&str>,
    ) -> Result<Vec<Option<Vec<u8>>>, WorkerError> {
        let mut out = vec![None; keys.len()];
        self.inner.load(keys, route_key, &mut |i, b| {
            let mut v = vec![0u8; b.len()];
            crate::dax::copy::copy_out(&mut v, b);
            out[i] = Some(v)
        })?;
        Ok(out)
    }

    /// Loads the chunks of one request straight into the caller's buffers (one copy:
    /// from the staging slot on `remote_cxl`, from the shared mapping on `cxl`).
    pub fn load_into(
        &self,
        keys: &[String],
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
        self.inner.load(keys, route_key, &mut |i, b| {
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

    pub fn exists_batch(
        &self,
        keys: &[String],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first);
        self.inner
            .with_pool(rk, vec![false; keys.len()], |p| p.exists(keys))
    }

    /// Unpublishes keys this engine stored; per key: removed, not found, stored by
    /// another engine (refused), or leased by a reader now (refused). A pool that is
    /// unavailable answers `NotFound`.
    pub fn remove_batch(
        &self,
        keys: &[String],
        route_key: Option<&str>,
    ) -> Result<Vec<crate::wire::meta::RemoveResult>, WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first);
        self.inner.with_pool(
            rk,
            vec![crate::wire::meta::RemoveResult::NotFound; keys.len()],
            |p| p.remove(keys),
        )
    }

    /// Pins keys of one request (`pin`), or drops one pin of each (`!pin`): a pinned
    /// key is neither evicted nor removed (by anyone) until this handler unpins it or
    /// closes, or its region is lost. Per key: pinned (found) / a pin was dropped. A
    /// pool that is unavailable answers `false`.
    pub fn pin_batch(
        &self,
        keys: &[String],
        route_key: Option<&str>,
        pin: bool,
    ) -> Result<Vec<bool>, WorkerError> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let rk = route_key.unwrap_or(first);
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
        self.inner.acquire_slots(pool, n, timeout)
    }

    /// Gives slots back. A slot lent to a running operation is refused (`Busy`).
    pub fn release_slots(&self, ids: &[u64]) -> Result<(), WorkerError> {
        self.inner.slot_table()?.release(ids)
    }

    /// Stores `lens[i]` bytes of slot `ids[i]` under `keys[i]`, without a copy on
    /// `remote_cxl` (the WRITE goes from the slot). The slots stay the caller's, except
    /// one whose transfer outcome was unknown: libmaru keeps it (its id is no longer
    /// valid; releasing it is a no-op).
    pub fn store_slots(
        &self,
        keys: &[String],
        ids: &[u64],
        lens: &[usize],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let lent = self.inner.lend(ids)?;
        self.inner.store_slots(keys, ids, lent, lens, route_key)
    }

    /// Loads chunk `keys[i]` into slot `ids[i]` (the READ lands in the slot); `Some(len)`
    /// where it was loaded. The slots stay the caller's, as for `store_slots`.
    pub fn load_slots(
        &self,
        keys: &[String],
        ids: &[u64],
        route_key: Option<&str>,
    ) -> Result<Vec<Option<usize>>, WorkerError> {
        let lent = self.inner.lend(ids)?;
        self.inner.load_slots(keys, ids, lent, route_key)
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

    /// Views of chunks in place, without a copy (`cxl` only: this host's read-only
    /// mapping of the region). Each found key's view holds a lease: its bytes stay the
    /// key's until [`Handler::release_views`], for at most `valid_ms`.
    pub fn acquire_views(
        &self,
        keys: &[String],
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
        let rk = route_key.unwrap_or(first);
        let got = self
            .inner
            .with_pool(rk, vec![None; keys.len()], |p| p.acquire_views(keys))?;
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
        self.inner.end_leases(held);
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
            let g = p.lock();
            let s = g.as_ref().ok().and_then(|g| g.as_ref().map(|p| p.stats()));
            if let Some(s) = &s {
                total.stored += s.stored;
                total.store_skipped += s.store_skipped;
                total.already_present += s.already_present;
                total.bytes_stored += s.bytes_stored;
                total.hits += s.hits;
                total.misses += s.misses;
                total.load_failed += s.load_failed;
                total.bytes_loaded += s.bytes_loaded;
                total.regions += s.regions;
                total.regions_ahead += s.regions_ahead;
                total.prefaulted_bytes += s.prefaulted_bytes;
                total.regions_lost += s.regions_lost;
            }
            pools.push(
                serde_json::json!({"url": self.inner.urls[i], "up": s.is_some(), "stats": s}),
            );
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
        serde_json::json!({"backend": backend, "engine_id": self.inner.cfg.engine_id, "pools": pools, "total": total, "staging": staging})
    }

    /// Closes every session (drained: regions with keys go to maru-server's keeper).
    pub fn close(&self) -> Result<(), WorkerError> {
        {
            let _g = self.inner.wake.0.lock();
            if self.inner.stop.swap(true, Ordering::SeqCst) {
                return Ok(());
            }
            self.inner.wake.1.notify_all();
        }
        if let Some(h) = self.background.lock().ok().and_then(|mut b| b.take()) {
            let _ = h.join();
        }
        // Operations already running finish; queued ones fail with `Closed`.
        self.inner.executor.shutdown();
        let mut first_err = None;
        for (i, p) in self.inner.pools.iter().enumerate() {
            if let Ok(mut g) = p.lock() {
                if let Some(mut pool) = g.take() {
                    if let Err(e) = pool.close() {
                        log::warn!("pool {}: close failed: {e}", self.inner.urls[i]);
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        if let Ok(mut t) = self.inner.slots.lock() {
            t.clear();
        }
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
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
