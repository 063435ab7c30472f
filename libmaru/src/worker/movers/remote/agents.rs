//! The agents of a remote mover: one control connection each (map, map_read,
//! release), a short-timeout probe connection, the transport peer, and what the
//! region lifecycle makes of what they say (a restart maps the regions again, a
//! reboot puts them out of use until maru-server dropped their keys).

use super::{AgentConn, ReadTarget, RemoteState};
use crate::net::{Link, LinkError};
use crate::transport::{PeerId, TransportError};
use crate::wire::agent::{AgentReply, AgentRequest};
use crate::wire::meta::LeaseGrant;
use crate::worker::agents::{require_boot_id, welcome_identity};
use crate::worker::clock::now_ms;
use crate::worker::error::WorkerError;
use crate::worker::lifecycle::Verdict;
use std::time::Duration;

/// Timeouts of an agent probe (connect, then the status call): short, because a
/// probe runs under the pool's and the mover state's locks and an agent that does not answer is the case
/// it is there to find.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

impl RemoteState {
    pub(super) fn agent(&mut self, addr: &str) -> &mut AgentConn {
        let opts = self.agent_opts.clone();
        self.agents
            .entry(addr.to_string())
            .or_insert_with(|| AgentConn {
                link: Link::new(addr, opts).with_check(require_boot_id),
                peer: None,
            })
    }

    /// Connects to `addr` if needed and tells the lifecycle who answered.
    pub(super) fn connect_agent(&mut self, addr: &str) -> Result<(), WorkerError> {
        let now = now_ms();
        let conn = self.agent(addr);
        if conn.link.is_connected() {
            return Ok(());
        }
        let seen = conn.link.client().map(|c| welcome_identity(c));
        match seen {
            Ok((boot, epoch)) => {
                let v = self.life.seen(addr, boot.as_deref(), epoch, now);
                self.on_verdict(addr, v)
            }
            Err(e) => {
                self.life.unreachable(addr, now);
                Err(e.into())
            }
        }
    }

    /// Carries out what the lifecycle made of an agent's identity.
    pub(super) fn on_verdict(&mut self, addr: &str, v: Verdict) -> Result<(), WorkerError> {
        match v {
            Verdict::Same => return Ok(()),
            Verdict::NoBoot => {
                self.agent(addr).link.reset();
                return Err(WorkerError::Unavailable(format!(
                    "agent {addr} reports no boot id: treated as unreachable"
                )));
            }
            Verdict::Restarted => log::info!(
                "agent {addr} restarted (same boot): mapping this worker's regions there again"
            ),
            Verdict::Rebooted(ids) => log::warn!(
                "the memory node of agent {addr} rebooted (new boot id): the keys of region(s) {ids:?} died with it; maru-server is told before they are used again"
            ),
        }
        // Its registrations and data connection are gone with the old process.
        let conn = self.agent(addr);
        let peer = conn.peer.take();
        if let Some(p) = peer {
            self.iso.fence(self.nic.as_ref(), p);
        }
        self.reads.retain(|_, t| t.0 != addr);
        Ok(())
    }

    pub(super) fn agent_call(
        &mut self,
        addr: &str,
        req: &AgentRequest,
    ) -> Result<AgentReply, WorkerError> {
        self.connect_agent(addr)?;
        let conn = self.agent(addr);
        let mut r = conn.link.call::<_, AgentReply>(req);
        if !conn.link.is_connected() {
            // The connection broke (the agent may have restarted, losing its
            // registrations): a new connection is a new peer at the transport too,
            // and this mover's regions there are mapped again before their next use.
            conn.peer = None;
            self.life.link_broken(addr);
            // Read registrations went with the old connection.
            self.reads.retain(|_, t| t.0 != addr);
            if r.is_err() {
                // Failed on the dead connection, so the agent never saw it: once more
                // on a fresh one.
                self.connect_agent(addr)?;
                r = self.agent(addr).link.call::<_, AgentReply>(req);
            }
        }
        if let Err(LinkError::Unreachable(_)) = &r {
            self.life.unreachable(addr, now_ms());
        }
        Ok(r?)
    }

    /// Asks whether `addr` answers, on a connection of its own (short timeouts, and a
    /// client id of its own: the agent drops a client's read handles when one of its
    /// connections closes, and this one holds none). The request is the cheapest the
    /// agent has (an unmap of no region: nothing changes); who answers (boot id,
    /// epoch) is in the welcome of the connection, checked on every probe, so a
    /// restart is seen as soon as the old connection is found dead and a new one made.
    pub(super) fn probe(&mut self, addr: &str, now: u64) {
        let mut opts = self.agent_opts.clone();
        opts.client_id = format!("{}#probe", opts.client_id);
        opts.connect_timeout = PROBE_TIMEOUT;
        opts.call_timeout = PROBE_TIMEOUT;
        let link = self
            .probes
            .entry(addr.to_string())
            .or_insert_with(|| Link::new(addr, opts).with_check(require_boot_id));
        let ping = AgentRequest::Unmap {
            region_id: u64::MAX,
        };
        let was = link.is_connected();
        let mut r = link.call::<_, AgentReply>(&ping);
        if r.is_err() && was && !link.is_connected() {
            // The old connection was dead (a restart, say): once on a fresh one.
            r = link.call::<_, AgentReply>(&ping);
        }
        let who = match r {
            Ok(_) => link.client().map(|c| welcome_identity(c)),
            Err(e) => Err(e),
        };
        match who {
            Ok((boot, epoch)) => {
                let v = self.life.seen(addr, boot.as_deref(), epoch, now);
                if v != Verdict::Same {
                    // The control connection went with the old process: the next
                    // call connects afresh (and its welcome is checked again).
                    self.agent(addr).link.reset();
                }
                if let Err(e) = self.on_verdict(addr, v) {
                    log::warn!("{e}");
                }
            }
            Err(e) => {
                log::debug!("agent {addr} did not answer a probe: {e}");
                self.life.unreachable(addr, now);
            }
        }
    }

    pub(super) fn peer(
        &mut self,
        addr: &str,
        meta: &serde_json::Value,
    ) -> Result<PeerId, WorkerError> {
        if let Some(p) = self.agent(addr).peer {
            return Ok(p);
        }
        let nic = self.nic.clone();
        let conn = self.agent(addr);
        let link = &mut conn.link;
        let mut bringup = |info: &serde_json::Value| -> Result<serde_json::Value, TransportError> {
            match link.call::<_, AgentReply>(&AgentRequest::ConnectPeer { info: info.clone() }) {
                Ok(AgentReply::Peer { info }) => Ok(info),
                Ok(r) => Err(TransportError::Setup(format!("unexpected reply {r:?}"))),
                Err(e) => Err(TransportError::Setup(e.to_string())),
            }
        };
        let p = nic
            .connect(meta, &mut bringup)
            .map_err(|e| WorkerError::Unavailable(format!("agent {addr}: {e}")))?;
        conn.peer = Some(p);
        Ok(p)
    }

    /// A peer whose batch failed with a known outcome: closed at the transport and
    /// forgotten; its agent's own regions are mapped again before their next use.
    pub(super) fn drop_failed_peer(&mut self, peer: PeerId) {
        let mut dropped = false;
        for (addr, c) in self.agents.iter_mut() {
            if c.peer == Some(peer) {
                c.peer = None;
                // The agent's control connection likely went with it (a restart):
                // connect afresh rather than find out on the next call.
                c.link.reset();
                self.life.link_broken(addr);
                dropped = true;
            }
        }
        // A closed control connection takes its read registrations with it.
        if dropped {
            self.reads.clear();
        }
        // Recorded: only a fence that succeeded lets pages of its WRITEs be reused.
        self.iso.fence(self.nic.as_ref(), peer);
    }

    /// Maps this mover's own regions again at the agents whose registrations may be
    /// gone (a broken connection, a restart), unless one of them waits for
    /// maru-server to hear of a reboot. The agent keeps a region's bytes across its
    /// restart, not its registration. An agent that cannot be reached stays due.
    pub(super) fn remap_failed_agents(&mut self) {
        let mut agents: Vec<String> = self.own.values().map(|r| r.agent.clone()).collect();
        agents.sort();
        agents.dedup();
        agents.retain(|a| self.life.needs_remap(a) && self.life.may_map(a));
        for agent in agents {
            self.remap_agent(&agent);
        }
    }

    pub(super) fn remap_agent(&mut self, agent: &str) {
        // Connect first: a new connection's welcome may reveal a reboot, and then
        // nothing is mapped before maru-server dropped the keys.
        if let Err(e) = self.connect_agent(agent) {
            log::debug!("mapping again at agent {agent}: {e}");
            return;
        }
        if !self.life.may_map(agent) {
            return;
        }
        let regions: Vec<(u64, crate::wire::rm::Handle)> = self
            .own
            .iter()
            .filter(|(_, r)| r.agent == agent)
            .map(|(id, r)| (*id, r.handle.clone()))
            .collect();
        let mut all = true;
        for (id, handle) in regions {
            let req = AgentRequest::Map {
                handle,
                writable: true,
            };
            match self.agent_call(agent, &req) {
                Ok(AgentReply::Mapped(m)) => {
                    let v = self.life.seen(agent, Some(&m.boot_id), None, now_ms());
                    let same = v == Verdict::Same;
                    if let Err(e) = self.on_verdict(agent, v) {
                        log::warn!("region {id}: {e}");
                    }
                    if !same || !self.life.may_map(agent) {
                        all = false;
                        break;
                    }
                    if let Some(r) = self.own.get_mut(&id) {
                        r.map = m;
                    }
                }
                Ok(r) => {
                    log::warn!("region {id}: agent {agent} answered map with {r:?}");
                    all = false;
                }
                Err(e) => {
                    log::debug!("region {id}: mapping again at agent {agent} failed: {e}");
                    all = false;
                    break;
                }
            }
        }
        if all {
            self.life.remapped(agent);
        }
    }

    /// Forgets the peers that isolation fenced.
    pub(super) fn forget_peers(&mut self, fenced: &[PeerId]) {
        for c in self.agents.values_mut() {
            if c.peer.is_some_and(|p| fenced.contains(&p)) {
                c.peer = None;
            }
        }
    }

    /// Where a lease's bytes are, if they may be read: only while their agent is on the
    /// boot the key was written under (else the memory node rebooted and maru-server
    /// has not heard it yet: the bytes are stale).
    pub(super) fn read_target(&mut self, l: &LeaseGrant) -> Result<ReadTarget, WorkerError> {
        let t = self.locate(l)?;
        if !self.life.lease_readable(&t.0, l.boot_id.as_deref()) {
            return Err(WorkerError::Unavailable(format!(
                "region {}: written under boot id {}, which its agent {} no longer runs (the memory node rebooted): nothing is read",
                l.region_id,
                l.boot_id.as_deref().unwrap_or("?"),
                t.0
            )));
        }
        Ok(t)
    }

    /// Where a lease's bytes are: our own mapping, or a read registration at its agent.
    fn locate(&mut self, l: &LeaseGrant) -> Result<ReadTarget, WorkerError> {
        if let Some(r) = self.own.get(&l.region_id) {
            if !self.life.usable(l.region_id) {
                return Err(WorkerError::Unavailable(format!(
                    "region {}: its memory node rebooted; its keys are being dropped",
                    l.region_id
                )));
            }
            return Ok((
                r.agent.clone(),
                r.map.addr + l.offset,
                r.map.rkey,
                r.map.transport.clone(),
            ));
        }
        if let Some(t) = self.reads.get(&(l.region_id, l.offset, l.length)) {
            return Ok(t.clone());
        }
        let agent = l.agent.clone().ok_or_else(|| {
            WorkerError::Transport(format!("lease {} names no agent", l.lease_id))
        })?;
        let req = AgentRequest::MapRead {
            region_id: l.region_id,
            offset: l.offset,
            length: l.length,
            read_token: l.read_token.clone(),
        };
        let m = match self.agent_call(&agent, &req) {
            Ok(AgentReply::Mapped(m)) => m,
            Ok(r) => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} answered map_read with {r:?}"
                )))
            }
            Err(e) => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} refused to map region {} for reading: {e}",
                    l.region_id
                )))
            }
        };
        let v = self.life.seen(&agent, Some(&m.boot_id), None, now_ms());
        self.on_verdict(&agent, v)?;
        let t = (agent, m.addr, m.rkey, m.transport);
        self.reads
            .insert((l.region_id, l.offset, l.length), t.clone());
        Ok(t)
    }
}
