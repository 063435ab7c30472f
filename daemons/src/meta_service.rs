//! maru-server on the event loop: the metadata core with its ports wired to the RM
//! (as the owner of every region it hands out) and to the pool's agents (for the
//! region keeper only; the data path never passes through here).

use maru::meta::{AgentPort, MetaCore, PortError, RmPort};
use maru::net::{ClientOptions, ConnId, Link, LinkError, Service};
use maru::wire::agent::{AgentReply, AgentRequest};
use maru::wire::meta::{MetaRequest, SERVICE};
use maru::wire::rm::{AllocReply, Handle, RmReply, RmRequest};
use maru::wire::{self, Envelope};
use std::collections::HashMap;
use std::time::Duration;

fn port_error(e: LinkError) -> PortError {
    match e {
        LinkError::Remote(w) => PortError::from(w),
        LinkError::Unreachable(m) | LinkError::Rejected(m) => PortError::Unreachable(m),
    }
}

fn unexpected<T: std::fmt::Debug>(r: T) -> PortError {
    PortError::Failed(format!("unexpected reply {r:?}"))
}

/// The RM as maru-server uses it.
pub struct MetaRm {
    link: Link,
    /// This server's client id at the RM (the owner of its regions).
    client_id: String,
}

impl MetaRm {
    pub fn new(addr: &str, client_id: String, key: Option<maru::auth::SharedKey>) -> MetaRm {
        let mut opts = ClientOptions::new(maru::wire::rm::SERVICE, client_id.clone());
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        MetaRm {
            link: Link::new(addr, opts),
            client_id,
        }
    }

    /// Connects now (maru-server refuses to start without its RM).
    pub fn check(&mut self) -> Result<(), String> {
        self.link.client().map(|_| ()).map_err(|e| e.to_string())
    }
}

impl RmPort for MetaRm {
    fn alloc(&mut self, size: u64) -> Result<AllocReply, PortError> {
        match self
            .link
            .call(&RmRequest::Alloc {
                size,
                pool: None,
                request_id: 0,
            })
            .map_err(port_error)?
        {
            RmReply::Alloc(a) => Ok(a),
            r => Err(unexpected(r)),
        }
    }

    fn free(&mut self, h: &Handle) -> Result<(), PortError> {
        match self
            .link
            .call(&RmRequest::Free {
                handle: h.clone(),
                request_id: 0,
            })
            .map_err(port_error)?
        {
            RmReply::Free(_) => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    fn owned_regions(&mut self) -> Result<Vec<u64>, PortError> {
        match self
            .link
            .call(&RmRequest::Regions {
                owner: Some(self.client_id.clone()),
            })
            .map_err(port_error)?
        {
            RmReply::Regions { regions } => Ok(regions.into_iter().map(|r| r.region_id).collect()),
            r => Err(unexpected(r)),
        }
    }

    fn largest_pool(&mut self) -> Result<u64, PortError> {
        match self.link.call(&RmRequest::Pools).map_err(port_error)? {
            RmReply::Pools { pools } => Ok(pools.iter().map(|p| p.total).max().unwrap_or(0)),
            r => Err(unexpected(r)),
        }
    }
}

/// The pool's agents, one reconnecting link each.
pub struct MetaAgents {
    links: HashMap<String, Link>,
    opts: ClientOptions,
}

impl MetaAgents {
    pub fn new(client_id: String, key: Option<maru::auth::SharedKey>) -> MetaAgents {
        let mut opts = ClientOptions::new(maru::wire::agent::SERVICE, client_id);
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        MetaAgents {
            links: HashMap::new(),
            opts,
        }
    }

    fn link(&mut self, agent: &str) -> &mut Link {
        let opts = self.opts.clone();
        self.links.entry(agent.to_string()).or_insert_with(|| {
            Link::new(agent, opts).with_check(maru::worker::agents::require_boot_id)
        })
    }
}

impl AgentPort for MetaAgents {
    fn map(&mut self, agent: &str, h: &Handle) -> Result<String, PortError> {
        match self
            .link(agent)
            .call(&AgentRequest::Map {
                handle: h.clone(),
                writable: false,
            })
            .map_err(port_error)?
        {
            AgentReply::Mapped(m) if !m.boot_id.is_empty() => Ok(m.boot_id),
            AgentReply::Mapped(_) => Err(PortError::Unreachable(format!(
                "agent {agent} reported no boot id"
            ))),
            r => Err(unexpected(r)),
        }
    }

    fn release(&mut self, agent: &str, h: &Handle) -> Result<(), PortError> {
        match self
            .link(agent)
            .call(&AgentRequest::Release { handle: h.clone() })
            .map_err(port_error)?
        {
            AgentReply::Released { .. } => Ok(()),
            r => Err(unexpected(r)),
        }
    }
}

pub struct MetaService {
    pub core: MetaCore,
    pub rm: MetaRm,
    pub agents: MetaAgents,
}

impl Service for MetaService {
    fn service_name(&self) -> &'static str {
        SERVICE
    }

    fn on_request(&mut self, _conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        let env: Envelope<MetaRequest> = match wire::decode_json(body) {
            Ok(e) => e,
            Err(e) => {
                log::info!("bad request from {client_id}: {}", e.message);
                return wire::reply_frame::<()>(wire::request_id_of(body), Err(e));
            }
        };
        let result = self.core.handle(client_id, env.body, now_ms, &mut self.rm);
        if let Err(e) = &result {
            log::debug!("request {} from {client_id}: {e}", env.id);
        }
        wire::reply_frame(env.id, result)
    }

    fn on_close(&mut self, _conn: ConnId, client_id: &str, now_ms: u64) {
        self.core.client_closed(client_id, now_ms);
    }

    fn on_tick(&mut self, now_ms: u64) {
        self.core.tick(now_ms, &mut self.rm, &mut self.agents);
    }

    fn next_deadline(&self) -> Option<u64> {
        self.core.next_deadline()
    }

    /// On SIGTERM: give every kept region back (released at its agent, then freed at the
    /// RM), waiting at most 10 s for the agents and the RM.
    fn on_shutdown(&mut self, now_ms: u64) {
        let n = self.core.give_back_kept(now_ms);
        let start = std::time::Instant::now();
        let mut now = now_ms;
        while self.core.regions_going_back() > 0 && start.elapsed() < Duration::from_secs(10) {
            self.core.tick(now, &mut self.rm, &mut self.agents);
            if self.core.regions_going_back() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            now += 100;
        }
        let left = self.core.regions_going_back();
        if left > 0 {
            log::warn!("stopping with {left} region(s) not yet given back; the RM frees them after its grace period");
        } else if n > 0 {
            log::info!("gave {n} kept region(s) back before stopping");
        }
    }
}
