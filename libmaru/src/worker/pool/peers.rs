//! The `remote_cxl` part of the pool core's state ([`RemoteState`]).

use crate::net::ClientOptions;
use crate::transport::PeerId;
use crate::wire::agent::MapReply;
use crate::worker::lifecycle::Lifecycle;
use crate::worker::movers::remote::isolation::Isolation;
use crate::worker::movers::remote::link::AgentLink;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub(crate) struct OwnRegion {
    pub(crate) agent: String,
    pub(crate) handle: crate::wire::rm::Handle,
    pub(crate) map: MapReply,
}

pub(crate) struct AgentConn {
    /// The control connection, taken out by one caller at a time (see `link`).
    pub(crate) link: Arc<AgentLink>,
    pub(crate) peer: Option<PeerId>,
}

/// Agents and their peers, the own regions' maps, read registrations, the region
/// lifecycle, transfer isolation: changed under the core's lock, never waited on.
pub struct RemoteState {
    pub(crate) agent_opts: ClientOptions,
    pub(crate) agents: HashMap<String, AgentConn>,
    pub(crate) own: HashMap<u64, OwnRegion>,
    /// Read registrations of leased ranges: (region, offset, length) → where.
    pub(crate) reads: HashMap<(u64, u64, u64), ReadTarget>,
    /// The own regions' lifecycle (boot ids, restarts, silent agents).
    pub(crate) life: Lifecycle,
    /// How many reboots were found (see `PoolCore::heartbeat_begin`).
    pub(crate) reboots: u64,
    /// Why the last failed read failed, for the caller.
    pub(crate) read_error: Option<String>,
    /// Peers to fence once the lock is let go (a fence waits on the peer).
    pub(crate) to_fence: Vec<PeerId>,
    /// Slots of transfers of unknown outcome, and what is known of their peers.
    pub(crate) iso: Isolation,
}

/// A remote range to READ: its agent, address, key and transport metadata.
pub(crate) type ReadTarget = (String, u64, u64, serde_json::Value);

impl RemoteState {
    /// The state of a pool whose agents are reached with `agent_opts`.
    pub fn new(agent_opts: ClientOptions) -> RemoteState {
        RemoteState {
            agent_opts,
            agents: HashMap::new(),
            own: HashMap::new(),
            reads: HashMap::new(),
            life: Lifecycle::default(),
            reboots: 0,
            read_error: None,
            to_fence: Vec::new(),
            iso: Isolation::default(),
        }
    }

    /// The region is no longer the session's: nothing more is written into it or read
    /// through its registrations.
    pub fn forget_region(&mut self, region_id: u64) {
        self.own.remove(&region_id);
        self.life.forget(region_id);
        self.reads.retain(|&(r, _, _), _| r != region_id);
    }
}

/// Where WRITEs into an own region go: its agent's data connection and the region's
/// registration there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteTo {
    pub peer: PeerId,
    pub addr: u64,
    pub rkey: u64,
}

/// The targets of the regions a store took pages of, by region (`Taken::to`).
pub type WriteTargets = BTreeMap<u64, WriteTo>;
