//! The remote CXL agent on the event loop: the agent core with its ports wired to a
//! real RM client, DAX mappings and the transport's target (soft NIC or verbs).

use crate::metrics::{Metrics, Refresh};
use crate::off_loop::Lane;
use crate::request;
use maru::agent::{AgentCore, MappedRange, MemPort, NicPort, Registration, RmCallError, RmPort};
use maru::dax::{self, Mapping};
use maru::net::{ClientOptions, ConnId, Link, LinkError, Service};
use maru::transport::Target;
use maru::wire::agent::{AgentReply, AgentRequest, SERVICE};
use maru::wire::rm::{AccessReply, Handle, RmReply, RmRequest};
use maru::wire::{self, Envelope, ErrorCode, WireError};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The agent's gauges (`maru_agent_<name>`).
pub const AGENT_GAUGES: &[(&str, &str)] = &[
    ("mappings", "Regions mapped (live or retiring)"),
    (
        "registrations",
        "Live NIC registrations of regions and read ranges",
    ),
    (
        "holders",
        "Holders of mapped regions (owners, keepers, readers)",
    ),
    (
        "released_mappings",
        "Mappings their owner released, waiting for their last holder",
    ),
    (
        "quarantined",
        "Deregistered ranges kept mapped without access",
    ),
    ("queued_unholds", "Unholds the RM has not confirmed yet"),
    (
        "failed_deregistrations",
        "Deregistrations that failed, retried by the sweep",
    ),
    (
        "holds_reset_pending",
        "1 while the hold reset sent at start has not reached the RM",
    ),
];

/// The RM, reached over a reconnecting link. Only an RM answer with code `refused`
/// is a refusal.
pub struct RmLink {
    link: Link,
}

impl RmLink {
    pub fn new(addr: String, client_id: String, key: Option<maru::auth::SharedKey>) -> RmLink {
        let mut opts = ClientOptions::new(maru::wire::rm::SERVICE, client_id);
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        RmLink {
            link: Link::new(addr, opts),
        }
    }

    fn call(&mut self, req: &RmRequest) -> Result<RmReply, RmCallError> {
        match self.link.call::<_, RmReply>(req) {
            Ok(r) => Ok(r),
            Err(LinkError::Remote(e)) => Err(RmCallError::from(e)),
            Err(e) => Err(RmCallError::Failed(e.to_string())),
        }
    }
}

fn unexpected(r: RmReply) -> RmCallError {
    RmCallError::Failed(format!("unexpected RM reply {r:?}"))
}

impl RmPort for RmLink {
    fn hold(&mut self, h: &Handle, node: &str, epoch: u64) -> Result<(), RmCallError> {
        match self.call(&RmRequest::Hold {
            handle: h.clone(),
            node: node.into(),
            epoch,
        })? {
            RmReply::Hold(_) => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    fn unhold(&mut self, region_id: u64, node: &str, epoch: u64) -> Result<(), RmCallError> {
        match self.call(&RmRequest::Unhold {
            region_id,
            node: node.into(),
            epoch,
        })? {
            RmReply::Unhold(_) => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    fn get_access(&mut self, h: &Handle) -> Result<AccessReply, RmCallError> {
        match self.call(&RmRequest::GetAccess { handle: h.clone() })? {
            RmReply::Access(a) => Ok(a),
            r => Err(unexpected(r)),
        }
    }

    fn reset_holds(&mut self, node: &str, epoch: u64) -> Result<(), RmCallError> {
        match self.call(&RmRequest::ResetHolds {
            node: node.into(),
            epoch,
        })? {
            RmReply::ResetHolds(_) => Ok(()),
            r => Err(unexpected(r)),
        }
    }
}

/// Mappings of DAX ranges, found on this node by device UUID.
pub struct DaxMem {
    /// UUID → local path of the device (from `--device` flags).
    local: HashMap<String, String>,
    maps: HashMap<u64, Mapping>,
    next: u64,
}

impl DaxMem {
    /// `devices`: this node's DAX devices or fake-DAX files.
    pub fn new(devices: &[String]) -> Result<DaxMem, String> {
        let mut local = HashMap::new();
        for d in devices {
            match dax::scan_uuid(d) {
                Ok(Some(uuid)) => {
                    log::info!("device {d}: uuid {uuid}");
                    local.insert(uuid, d.clone());
                }
                Ok(None) => {
                    return Err(format!(
                        "device {d} has no Maru header; start the resource manager on it first"
                    ))
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(DaxMem {
            local,
            maps: HashMap::new(),
            next: 1,
        })
    }

    fn resolve(&self, access: &AccessReply) -> Result<String, String> {
        if let Some(p) = self.local.get(&access.uuid) {
            return Ok(p.clone());
        }
        // As the upstream client does: the RM's path is used only if the device there
        // carries the same UUID (the same device under the same name on this node).
        match dax::scan_uuid(&access.path) {
            Ok(Some(u)) if u == access.uuid => Ok(access.path.clone()),
            Ok(_) => Err(format!(
                "device {} of region {} (uuid {}) is not on this node: pass its local path with --device",
                access.path, access.region_id, access.uuid
            )),
            Err(e) => Err(format!("region {}: {e}; pass the device's local path with --device", access.region_id)),
        }
    }
}

impl MemPort for DaxMem {
    fn map(&mut self, access: &AccessReply) -> Result<MappedRange, String> {
        let path = self.resolve(access)?;
        let m = dax::map_range(
            &path,
            dax::kind_of_path(&path),
            access.offset,
            access.length,
            access.align,
            true,
        )
        .map_err(|e| e.to_string())?;
        let id = self.next;
        self.next += 1;
        let r = MappedRange {
            id,
            ptr: m.as_ptr() as u64,
            len: m.len() as u64,
        };
        self.maps.insert(id, m);
        Ok(r)
    }

    fn protect_none(&mut self, id: u64) -> Result<(), String> {
        match self.maps.get_mut(&id) {
            Some(m) => m.protect_none().map_err(|e| e.to_string()),
            None => Err(format!("no mapping {id}")),
        }
    }

    fn unmap(&mut self, id: u64) {
        self.maps.remove(&id);
    }
}

/// The transport's target as the core's NIC port.
#[derive(Clone)]
pub struct Nic {
    pub target: Arc<dyn Target>,
    /// The same target when it is verbs: its responder queue pairs belong to the agent
    /// connection that brought them up and go when it closes.
    #[cfg(feature = "verbs")]
    pub verbs: Option<Arc<maru::transport::verbs::VerbsTarget>>,
}

impl Nic {
    fn accept_peer(
        &self,
        conn: ConnId,
        info: &serde_json::Value,
    ) -> Result<serde_json::Value, maru::transport::TransportError> {
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            return v.accept_peer_on(conn, info);
        }
        let _ = conn;
        self.target.accept_peer(info)
    }

    fn connection_closed(&self, conn: ConnId) {
        // Its data paths go (responder queue pairs, soft NIC connections); its
        // registrations stay until deregistered, its protection domain with them.
        self.target.owner_closed(conn);
        #[cfg(feature = "verbs")]
        if let Some(v) = &self.verbs {
            v.sweep();
        }
    }
}

impl NicPort for Nic {
    fn register(
        &mut self,
        holder: &str,
        ptr: u64,
        len: u64,
        writable: bool,
    ) -> Result<Registration, String> {
        // The key is the holder's connection's only (its protection domain).
        let owner = conn_of(holder)
            .ok_or_else(|| format!("holder {holder:?} names no agent connection"))?;
        // SAFETY: the core deregisters a range before it asks the memory port to unmap it.
        unsafe { self.target.register(owner, ptr as *mut u8, len, writable) }
            .map_err(|e| e.to_string())
    }

    fn deregister(&mut self, rkey: u64) -> Result<(), String> {
        self.target.deregister(rkey).map_err(|e| e.to_string())
    }
}

/// Who holds what a connection maps: the connection itself (its id after the client
/// id it declared, for the operator's eye). Another connection naming the same client
/// id can neither unmap its regions nor, by closing, drop its read registrations.
fn holder_of(conn: ConnId, client_id: &str) -> String {
    format!("{client_id}#{conn}")
}

/// A queue-pair bring-up of connection `conn` (touches only the transport).
fn connect_peer(
    nic: &Nic,
    conn: ConnId,
    holder: &str,
    info: &serde_json::Value,
) -> Result<AgentReply, WireError> {
    nic.accept_peer(conn, info)
        .map(|info| AgentReply::Peer { info })
        .map_err(|e| {
            WireError::new(
                ErrorCode::Unsupported,
                format!("connect_peer from {}: {e}", maru::net::clip(holder)),
            )
        })
}

/// Whether a request body is a queue-pair bring-up (served off the core's thread:
/// RTR resolves neighbours, which may take seconds).
pub fn is_connect_peer(body: &[u8]) -> bool {
    matches!(
        wire::decode_json::<Envelope<AgentRequest>>(body),
        Ok(Envelope {
            body: AgentRequest::ConnectPeer { .. },
            ..
        })
    )
}

/// Serves queue-pair bring-ups on their own threads, next to the core's.
pub fn bringup_lane(nic: &Nic) -> Lane {
    let nic = nic.clone();
    Lane {
        picks: is_connect_peer,
        serve: std::sync::Arc::new(move |conn, client_id, body| {
            let holder = holder_of(conn, client_id);
            let (req, body) = match request::decode::<AgentRequest>(body, &holder, None) {
                Ok(r) => r,
                Err(reply) => return reply,
            };
            let result = match body {
                AgentRequest::ConnectPeer { info } => connect_peer(&nic, conn, &holder, &info),
                _ => Err(WireError::new(ErrorCode::Internal, "not a connect_peer")),
            };
            req.reply(result, &holder, log::Level::Info, None)
        }),
        threads: BRINGUP_THREADS,
    }
}

/// Threads serving queue-pair bring-ups at once.
pub const BRINGUP_THREADS: usize = 4;

/// The connection a holder stands for (see [`holder_of`]).
fn conn_of(holder: &str) -> Option<ConnId> {
    holder.rsplit_once('#')?.1.parse().ok()
}

/// How often the sweep runs.
pub const SWEEP_MS: u64 = 5_000;

pub struct AgentService {
    pub core: AgentCore,
    pub rm: RmLink,
    pub mem: DaxMem,
    pub nic: Nic,
    next_sweep: u64,
    /// `--metrics`: figures for Prometheus.
    metrics: Option<Arc<Metrics>>,
    refresh: Refresh,
    started: Instant,
}

impl AgentService {
    pub fn new(mut core: AgentCore, mut rm: RmLink, mem: DaxMem, nic: Nic) -> AgentService {
        core.start(&mut rm);
        AgentService {
            core,
            rm,
            mem,
            nic,
            next_sweep: SWEEP_MS,
            metrics: None,
            refresh: Refresh::new(1000),
            started: Instant::now(),
        }
    }

    /// Counts requests into `m` and copies the core's figures into its gauges.
    pub fn with_metrics(mut self, m: Arc<Metrics>) -> AgentService {
        self.metrics = Some(m);
        self
    }

    fn refresh_gauges(&mut self, now_ms: u64) {
        let Some(m) = &self.metrics else {
            return;
        };
        if !self.refresh.due(now_ms) {
            return;
        }
        let st = self.core.status();
        let sum = |f: fn(&maru::wire::agent::MappingInfo) -> usize| {
            st.mappings.iter().map(f).sum::<usize>() as i64
        };
        m.set("mappings", st.mappings.len() as i64);
        m.set("registrations", sum(|x| x.registrations));
        m.set("holders", sum(|x| x.holders.len()));
        m.set("released_mappings", sum(|x| usize::from(x.released)));
        m.set("failed_deregistrations", sum(|x| x.failed_deregistrations));
        m.set("quarantined", st.quarantined as i64);
        m.set("queued_unholds", st.queued_unholds as i64);
        m.set("holds_reset_pending", i64::from(st.holds_reset_pending));
    }

    fn info(&self) -> serde_json::Value {
        serde_json::json!({
            "boot_id": self.core.boot_id(),
            "node": self.core.node(),
            "epoch": self.core.epoch(),
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_s": self.started.elapsed().as_secs(),
        })
    }
}

impl Service for AgentService {
    fn service_name(&self) -> &'static str {
        SERVICE
    }

    fn welcome_info(&self) -> serde_json::Value {
        self.info()
    }

    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        let client_id = &holder_of(conn, client_id);
        let metrics = self.metrics.as_deref();
        let (req, body) = match request::decode::<AgentRequest>(body, client_id, metrics) {
            Ok(r) => r,
            Err(reply) => return reply,
        };
        let result = match body {
            AgentRequest::ConnectPeer { info } => connect_peer(&self.nic, conn, client_id, &info),
            body => self.core.handle(
                client_id,
                body,
                now_ms,
                &mut self.rm,
                &mut self.mem,
                &mut self.nic,
            ),
        };
        let frame = req.reply(result, client_id, log::Level::Info, metrics);
        if self.metrics.is_some() {
            self.refresh.touch();
            self.refresh_gauges(now_ms);
        }
        frame
    }

    fn on_close(&mut self, conn: ConnId, client_id: &str, now_ms: u64) {
        self.nic.connection_closed(conn);
        self.core.client_closed(
            &holder_of(conn, client_id),
            now_ms,
            &mut self.rm,
            &mut self.mem,
            &mut self.nic,
        );
    }

    fn on_tick(&mut self, now_ms: u64) {
        if now_ms >= self.next_sweep {
            self.core
                .sweep(now_ms, &mut self.rm, &mut self.mem, &mut self.nic);
            self.next_sweep = now_ms + SWEEP_MS;
            self.refresh.touch();
        }
        self.refresh_gauges(now_ms);
    }

    fn next_deadline(&self) -> Option<u64> {
        let gauges = self.metrics.as_ref().and_then(|_| self.refresh.deadline());
        let next = match self.core.next_deadline() {
            Some(d) => d.min(self.next_sweep),
            None => self.next_sweep,
        };
        Some(gauges.map_or(next, |g| g.min(next)))
    }
}
