//! The pool's agents as maru-server's region keeper calls them ([`MetaAgents`]): each
//! agent on a link thread of its own, a call holding the loop at most [`AGENT_WAIT`].

use crate::peer_calls::{port_error, unexpected, PeerCalls};
use maru::meta::{AgentPort, PortError};
use maru::net::{ClientOptions, Link};
use maru::wire::agent::{AgentReply, AgentRequest};
use maru::wire::rm::Handle;
use std::collections::HashMap;
use std::time::Duration;

/// How long a call to an agent may hold the event loop. A healthy agent answers well
/// within it; past it the call goes on in the background, the keeper sees the agent
/// as unreachable for now (it retries), and later calls take the answer.
pub const AGENT_WAIT: Duration = Duration::from_millis(20);

/// A call the keeper makes: map or release of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum CallKey {
    Map(u64),
    Release(u64),
}

type Answer = Result<String, PortError>;

/// One agent's calls ([`PeerCalls`]).
struct AgentWorker(PeerCalls<CallKey, AgentRequest, Answer>);

impl AgentWorker {
    fn start(agent: &str, opts: ClientOptions) -> AgentWorker {
        let mut link = Link::new(agent, opts).with_check(maru::worker::agents::require_boot_id);
        let name = format!("agent-link-{}", maru::net::clip(agent));
        AgentWorker(PeerCalls::start(name, move |req: AgentRequest| match link
            .call::<_, AgentReply>(&req)
            .map_err(port_error)
        {
            Ok(AgentReply::Mapped(m)) => Ok(m.boot_id),
            Ok(AgentReply::Released { .. }) => Ok(String::new()),
            Ok(r) => Err(unexpected(r)),
            Err(e) => Err(e),
        }))
    }

    fn call(&mut self, agent: &str, key: CallKey, req: AgentRequest, wait: Duration) -> Answer {
        self.0
            .call(&format!("agent {agent}"), key, req, wait)
            .unwrap_or_else(|m| Err(PortError::Unreachable(m)))
    }
}

/// The pool's agents, each on a link thread of its own ([`AgentWorker`]).
pub struct MetaAgents {
    workers: HashMap<String, AgentWorker>,
    opts: ClientOptions,
    /// How long a call may wait on the loop ([`AGENT_WAIT`]; longer at shutdown,
    /// when the loop serves nobody else).
    wait: Duration,
}

impl MetaAgents {
    pub fn new(client_id: String, key: Option<maru::auth::SharedKey>) -> MetaAgents {
        let mut opts = ClientOptions::new(maru::wire::agent::SERVICE, client_id);
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        MetaAgents {
            workers: HashMap::new(),
            opts,
            wait: AGENT_WAIT,
        }
    }

    /// Lets calls wait for their answer up to `wait` (at shutdown: the call timeout).
    pub fn set_wait(&mut self, wait: Duration) {
        self.wait = wait;
    }

    /// The options of the links to the agents (client id, key, timeouts).
    pub fn options(&self) -> ClientOptions {
        self.opts.clone()
    }

    fn worker(&mut self, agent: &str) -> &mut AgentWorker {
        let opts = self.opts.clone();
        self.workers
            .entry(agent.to_string())
            .or_insert_with(|| AgentWorker::start(agent, opts))
    }
}

impl AgentPort for MetaAgents {
    fn map(&mut self, agent: &str, h: &Handle) -> Result<String, PortError> {
        let req = AgentRequest::Map {
            handle: h.clone(),
            writable: false,
        };
        let wait = self.wait;
        match self
            .worker(agent)
            .call(agent, CallKey::Map(h.region_id), req, wait)
        {
            Ok(boot) if boot.is_empty() => Err(PortError::Unreachable(format!(
                "agent {agent} reported no boot id"
            ))),
            other => other,
        }
    }

    fn release(&mut self, agent: &str, h: &Handle) -> Result<(), PortError> {
        let req = AgentRequest::Release { handle: h.clone() };
        let wait = self.wait;
        self.worker(agent)
            .call(agent, CallKey::Release(h.region_id), req, wait)
            .map(|_| ())
    }
}
