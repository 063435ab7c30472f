//! The data path of a handler: the staging buffer (registered with the memory hook
//! and, for `remote_cxl`, with the transport), made from the first pool's page size,
//! and the pools' sessions and movers built on it.

use super::{DataPath, Inner};
use crate::auth::SharedKey;
use crate::net::ClientOptions;
use crate::transport::soft::SoftTransport;
use crate::transport::{LocalBuffer, Transport};
use crate::wire::meta::Backend;
use crate::worker::clock::Deadline;
use crate::worker::config::{BackendKind, HandlerConfig, TransportKind};
use crate::worker::error::WorkerError;
use crate::worker::movers::{CxlMover, Mover, RemoteMover};
use crate::worker::pool::StoragePool;
use crate::worker::session::Session;
use crate::worker::staging::{StagingLayout, StagingSlots};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
        TransportKind::Soft => Ok(Arc::new(
            SoftTransport::new(client_id.to_string(), Some(key.clone()))
                .with_lanes(cfg.rdma_qps_per_agent),
        )),
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
        qps_per_agent: cfg.rdma_qps_per_agent,
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
    pub(super) fn backend(&self) -> Backend {
        match self.cfg.backend {
            BackendKind::Cxl => Backend::Cxl,
            BackendKind::RemoteCxl => Backend::RemoteCxl,
        }
    }

    pub(super) fn timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.timeout_ms)
    }

    /// The data path, created from the first session's page size.
    pub(super) fn data_path(&self, page_size: u64) -> Result<Arc<DataPath>, WorkerError> {
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
        // No slot of a kind is allowed (0: that kind of slot transfer is skipped or
        // misses at once); none at all is a handler without staging buffer.
        layout
            .validate(page_size as usize, 0, 0)
            .map_err(WorkerError::Config)?;
        let staging = StagingSlots::new(layout).map_err(|e| {
            WorkerError::NoSpace(format!(
                "staging buffer of {} bytes: {e}",
                layout.total_bytes()
            ))
        })?;
        let (ptr, len) = staging.buffer();
        // Before the first transfer uses the buffer (and before the NIC registers it).
        let hook = match len {
            0 => None,
            _ => Some(crate::worker::hook::register(ptr, len, self.hook)?),
        };
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
                if len > 0 {
                    nic.register_local(LocalBuffer { ptr, len })
                        .map_err(|e| WorkerError::Config(e.to_string()))?;
                }
                agent_opts.key = Some(key);
                Some(nic)
            }
        };
        agent_opts.call_timeout = self.timeout();
        agent_opts.connect_timeout = self.timeout().min(Duration::from_secs(5));
        let dp = Arc::new(DataPath {
            hook: Mutex::new(hook),
            staging,
            nic,
            agent_opts,
            budget: Arc::default(),
        });
        *d = Some(dp.clone());
        Ok(dp)
    }

    pub(super) fn open_pool(&self, i: usize) -> Result<StoragePool, WorkerError> {
        let url = &self.urls[i];
        let key = self.cfg.server_key().map_err(WorkerError::Config)?;
        let session = Session::open(
            url,
            &self.client_id,
            key,
            &self.cfg.engine_id,
            &self.cfg.namespace,
            &self.cfg.layout,
            self.backend(),
            self.timeout(),
        )?;
        session.set_reply_spin(Duration::from_micros(self.cfg.reply_spin_us));
        // From here on a failure closes the session again: a failed open leaves none.
        let dp = match self.data_path(session.page_size) {
            Ok(dp) => dp,
            Err(e) => {
                session.close_failed_open(&e, Deadline::after(self.timeout()));
                return Err(e);
            }
        };
        let mover: Box<dyn Mover> = match &dp.nic {
            None => Box::new(CxlMover::with_prefault(self.cfg.prefault).with_hook(self.hook)),
            Some(nic) => Box::new(RemoteMover::new(
                nic.clone(),
                dp.staging.clone(),
                dp.agent_opts.clone(),
                self.timeout(),
                dp.budget.clone(),
            )),
        };
        let spare =
            crate::worker::pool::spare_pages(session.page_size, session.handshake.region_size);
        let pool = StoragePool::open(session, mover)?
            .with_timeout(self.timeout())
            .with_spare_pages(spare)
            .with_max_bytes(self.cfg.max_bytes);
        if let Err(e) = pool.greet_agents() {
            pool.session
                .close_failed_open(&e, Deadline::after(self.timeout()));
            return Err(e);
        }
        log::info!(
            "pool {url}: session {} opened (engine {}, backend {:?}, pages of {} bytes)",
            pool.session.id,
            self.cfg.engine_id,
            self.cfg.backend,
            pool.session.page_size
        );
        Ok(pool)
    }
}
