//! The agents of a remote mover: one control connection each (map, map_read,
//! release), a short-timeout probe connection, the transport peer, and what the region
//! lifecycle makes of what they say (a restart maps the regions again, a reboot puts
//! them out of use until maru-server dropped their keys). The map of a region taken,
//! a load's map_reads and the probes run without the state's lock (`Shared::adopt`,
//! `Shared::map_reads`, `Shared::probe`), holding only their connection.

use super::{AgentConn, ReadTarget, RemoteState, Shared};
use crate::net::{Link, LinkError};
use crate::transport::{PeerId, TransportError};
use crate::wire::agent::{AgentReply, AgentRequest, MapReply};
use crate::wire::meta::{LeaseGrant, RegionGrant};
use crate::worker::agents::{require_boot_id, welcome_identity};
use crate::worker::clock::now_ms;
use crate::worker::error::WorkerError;
use crate::worker::lifecycle::{Action, Verdict};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Timeouts of an agent probe (connect, then the status call): short, because a
/// probe holds the pool's tick (not the handler's requests: `Shared::probe`) and an
/// agent that does not answer is the case it is there to find.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

impl RemoteState {
    pub(super) fn agent(&mut self, addr: &str) -> &mut AgentConn {
        let opts = self.agent_opts.clone();
        self.agents
            .entry(addr.to_string())
            .or_insert_with(|| AgentConn {
                link: Arc::new(Mutex::new(
                    Link::new(addr, opts).with_check(require_boot_id),
                )),
                peer: None,
            })
    }

    /// Connects to `addr` if needed and tells the lifecycle who answered.
    pub(super) fn connect_agent(&mut self, addr: &str) -> Result<(), WorkerError> {
        let now = now_ms();
        let conn = self.agent(addr);
        if conn.link().is_connected() {
            return Ok(());
        }
        let seen = conn.link().client().map(|c| welcome_identity(c));
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
                self.agent(addr).link().reset();
                // Read registrations go with the connection.
                self.forget_reads(Some(addr));
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
        self.forget_reads(Some(addr));
        Ok(())
    }

    pub(super) fn agent_call(
        &mut self,
        addr: &str,
        req: &AgentRequest,
    ) -> Result<AgentReply, WorkerError> {
        self.connect_agent(addr)?;
        let conn = self.agent(addr);
        let mut r = conn.link().call::<_, AgentReply>(req);
        if !conn.link().is_connected() {
            self.link_broke(addr);
            if r.is_err() {
                // Failed on the dead connection, so the agent never saw it: once more
                // on a fresh one.
                self.connect_agent(addr)?;
                r = self.agent(addr).link().call::<_, AgentReply>(req);
            }
        }
        if let Err(LinkError::Unreachable(_)) = &r {
            self.life.unreachable(addr, now_ms());
        }
        Ok(r?)
    }

    /// The control connection to `addr` broke: the agent may have restarted, losing
    /// its registrations (read registrations go with the connection anyway); a new
    /// connection is a new peer at the transport too, and this mover's regions there
    /// are mapped again before their next use.
    fn link_broke(&mut self, addr: &str) {
        self.agent(addr).peer = None;
        self.life.link_broken(addr);
        self.forget_reads(Some(addr));
    }

    /// The probe connection to `addr` (short timeouts, and a client id of its own: the
    /// agent drops a client's read handles when one of its connections closes, and
    /// this one holds none).
    fn probe_link(&mut self, addr: &str) -> Arc<Mutex<Link>> {
        let mut opts = self.agent_opts.clone();
        opts.client_id = format!("{}#probe", opts.client_id);
        opts.connect_timeout = PROBE_TIMEOUT;
        opts.call_timeout = PROBE_TIMEOUT;
        self.probes
            .entry(addr.to_string())
            .or_insert_with(|| {
                Arc::new(Mutex::new(
                    Link::new(addr, opts).with_check(require_boot_id),
                ))
            })
            .clone()
    }

    /// What a probe of `addr` found out (`who`: the boot id and epoch that answered).
    fn probed(
        &mut self,
        addr: &str,
        now: u64,
        who: Result<(Option<String>, Option<u64>), LinkError>,
    ) {
        match who {
            Ok((boot, epoch)) => {
                let v = self.life.seen(addr, boot.as_deref(), epoch, now);
                if v != Verdict::Same {
                    // The control connection went with the old process: the next
                    // call connects afresh (and its welcome is checked again).
                    self.agent(addr).link().reset();
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
        let shared_link = conn.link.clone();
        let mut link = shared_link.lock().unwrap_or_else(|e| e.into_inner());
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
        drop(link);
        self.agent(addr).peer = Some(p);
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
                c.link().reset();
                self.life.link_broken(addr);
                dropped = true;
            }
        }
        // A closed control connection takes its read registrations with it.
        if dropped {
            self.forget_reads(None);
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
        let m = match self.agent_call(&agent, &map_read_request(l)) {
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
        self.reads.insert(range(l), t.clone());
        Ok(t)
    }

    /// Forgets the read registrations at `agent` (at every agent: None): the agent
    /// dropped them with a connection of this client, or a read failed. A `map_read`
    /// made without the lock that started before this is not recorded.
    pub(super) fn forget_reads(&mut self, agent: Option<&str>) {
        match agent {
            Some(a) => self.reads.retain(|_, t| t.0 != a),
            None => self.reads.clear(),
        }
        self.regs_gen += 1;
    }

    /// The ranges of `leases` in other engines' regions that have no read
    /// registration yet, by agent, each with the connection to ask on; and the
    /// registrations' generation now.
    fn reads_to_map(&mut self, leases: &[LeaseGrant]) -> (Vec<ToMap>, u64) {
        let mut out: Vec<ToMap> = Vec::new();
        for l in leases {
            if self.own.contains_key(&l.region_id) || self.reads.contains_key(&range(l)) {
                continue;
            }
            // No agent named: `locate` says so when the window is planned.
            let Some(agent) = l.agent.as_deref() else {
                continue;
            };
            let at = match out.iter().position(|t| t.agent == agent) {
                Some(at) => at,
                None => {
                    let link = self.agent(agent).link.clone();
                    out.push(ToMap {
                        agent: agent.to_string(),
                        link,
                        leases: Vec::new(),
                    });
                    out.len() - 1
                }
            };
            if !out[at].leases.iter().any(|m| range(m) == range(l)) {
                out[at].leases.push(l.clone());
            }
        }
        (out, self.regs_gen)
    }

    /// Records what `map_read` calls made without the lock got at `agent`, unless
    /// registrations were forgotten since they started (`gen`): `locate` then maps
    /// what it needs again.
    fn mapped_reads(&mut self, agent: &str, gen: u64, got: MapReads) {
        let stale = gen != self.regs_gen;
        if got.broke {
            self.link_broke(agent);
        }
        if got.unreachable {
            self.life.unreachable(agent, now_ms());
        }
        for (l, m) in got.mapped {
            let v = self.life.seen(agent, Some(&m.boot_id), None, now_ms());
            if let Err(e) = self.on_verdict(agent, v) {
                log::warn!("region {}: {e}", l.0);
                return;
            }
            if !stale && !got.broke {
                self.reads
                    .insert(l, (agent.to_string(), m.addr, m.rkey, m.transport));
            }
        }
    }
}

/// A lease's range: (region, offset, length).
fn range(l: &LeaseGrant) -> (u64, u64, u64) {
    (l.region_id, l.offset, l.length)
}

fn map_read_request(l: &LeaseGrant) -> AgentRequest {
    AgentRequest::MapRead {
        region_id: l.region_id,
        offset: l.offset,
        length: l.length,
        read_token: l.read_token.clone(),
    }
}

/// `req` on `link` if its connection is up (one that is down is connected under the
/// state's lock: `connect_agent` checks who answers), with whether the connection
/// broke on the way; None if it was down.
fn call_if_up(
    link: &mut Link,
    req: &AgentRequest,
) -> Option<(Result<AgentReply, LinkError>, bool)> {
    if !link.is_connected() {
        return None;
    }
    let r = link.call::<_, AgentReply>(req);
    Some((r, !link.is_connected()))
}

/// Asks `link`'s agent who it is (boot id, epoch). The request is the cheapest the
/// agent has (an unmap of no region: nothing changes); who answers is in the welcome
/// of the connection, checked on every probe, so a restart is seen as soon as the old
/// connection is found dead and a new one made.
fn ping(link: &mut Link) -> Result<(Option<String>, Option<u64>), LinkError> {
    let ping = AgentRequest::Unmap {
        region_id: u64::MAX,
    };
    let was = link.is_connected();
    let mut r = link.call::<_, AgentReply>(&ping);
    if r.is_err() && was && !link.is_connected() {
        // The old connection was dead (a restart, say): once on a fresh one.
        r = link.call::<_, AgentReply>(&ping);
    }
    r?;
    link.client().map(|c| welcome_identity(c))
}

/// Ranges to map for reading at one agent.
struct ToMap {
    agent: String,
    link: Arc<Mutex<Link>>,
    leases: Vec<LeaseGrant>,
}

/// What `map_read` calls on one connection got.
#[derive(Default)]
struct MapReads {
    mapped: Vec<((u64, u64, u64), MapReply)>,
    /// The connection broke on the way (what was mapped on it is gone).
    broke: bool,
    /// The agent did not answer (the outcome of the call is unknown).
    unreachable: bool,
}

/// Asks `link`'s agent to map each of `leases` for reading, on the connection that
/// is up: one that is down is connected under the state's lock (`connect_agent`
/// checks who answers), so nothing is asked here then, nor after a call broke it.
fn map_read_all(link: &mut Link, agent: &str, leases: &[LeaseGrant]) -> MapReads {
    let mut got = MapReads::default();
    for l in leases {
        let Some((r, broke)) = call_if_up(link, &map_read_request(l)) else {
            break;
        };
        got.broke |= broke;
        match r {
            Ok(AgentReply::Mapped(m)) => got.mapped.push((range(l), m)),
            Ok(other) => log::warn!(
                "agent {agent} answered map_read of region {} with {other:?}",
                l.region_id
            ),
            Err(e) => {
                // Said to the caller when the window is planned (`locate` asks again).
                log::debug!("agent {agent}: map_read of region {}: {e}", l.region_id);
                got.unreachable |= matches!(e, LinkError::Unreachable(_));
            }
        }
    }
    got
}

impl Shared {
    /// Maps a region this worker took at its agent and records it. The `map` round
    /// trip (the agent holds the region at the RM and registers it with its NIC: on
    /// verbs that pins the region's pages, tens of milliseconds for 256 MiB) holds
    /// the agent's control connection, not the state's lock: the handler's other
    /// requests go on meanwhile. Connecting, when the connection is down, and
    /// recording run under the lock; a map made on a connection that was down, broke,
    /// or may have lost its registrations meanwhile (`regs_gen`) is made again there.
    pub(super) fn adopt(&self, grant: &RegionGrant) -> Result<(), WorkerError> {
        let agent = grant.agent.clone().ok_or_else(|| {
            WorkerError::Config(format!(
                "region {} has no agent: maru-server runs without --remote-cxl-agent",
                grant.handle.region_id
            ))
        })?;
        let req = AgentRequest::Map {
            handle: grant.handle.clone(),
            writable: true,
        };
        let (link, gen) = {
            let mut st = self.lock();
            st.connect_agent(&agent)?;
            (st.agent(&agent).link.clone(), st.regs_gen)
        };
        let got = {
            let mut link = link.lock().unwrap_or_else(|e| e.into_inner());
            call_if_up(&mut link, &req)
        };
        let mut st = self.lock();
        let reply = match got {
            Some((Ok(r), _)) if st.regs_gen == gen => r,
            // Refused (the connection stays): said as `agent_call` says it.
            Some((Err(e), false)) => return Err(e.into()),
            Some((_, broke)) => {
                if broke {
                    st.link_broke(&agent);
                }
                st.agent_call(&agent, &req)?
            }
            None => st.agent_call(&agent, &req)?,
        };
        st.adopted(grant, agent, reply)
    }

    /// What is due on the pool's tick: probes (without the state's lock, `probe`),
    /// maps again after a restart, regions of agents silent too long to give back
    /// (returned).
    pub(super) fn tick(&self, now_ms: u64) -> Vec<u64> {
        let due = self.lock().life.due(now_ms);
        let mut give_back = Vec::new();
        for a in due {
            match a {
                Action::Probe(agent) => self.probe(&agent, now_ms),
                Action::Remap(agent) => self.lock().remap_agent(&agent),
                // The pool asks `must_report` after the tick.
                Action::ReportBoots => {}
                Action::GiveBack { agent, regions } => {
                    log::warn!(
                        "agent {agent} has not answered for {} s: giving region(s) {regions:?} back (their keys go)",
                        crate::worker::lifecycle::AGENT_SILENCE_MS / 1000
                    );
                    give_back.extend(regions);
                }
            }
        }
        // A probe may have found a restart: map again now, not at the next tick.
        self.lock().remap_failed_agents();
        give_back
    }

    /// Probes the agents of the own regions now.
    pub(super) fn check_agents(&self, now_ms: u64) {
        let mut agents: Vec<String> = self.lock().own.values().map(|r| r.agent.clone()).collect();
        agents.sort();
        agents.dedup();
        for a in agents {
            self.probe(&a, now_ms);
        }
    }

    /// Asks whether `addr` answers, and who (`ping`), on its probe connection and
    /// without the state's lock: an agent slow to answer (up to `PROBE_TIMEOUT` to
    /// connect and as much to reply) holds the tick, not the handler's requests.
    /// What it found is fed to the lifecycle under the lock.
    fn probe(&self, addr: &str, now: u64) {
        let link = self.lock().probe_link(addr);
        let who = ping(&mut link.lock().unwrap_or_else(|e| e.into_inner()));
        self.lock().probed(addr, now, who);
    }

    /// Maps for reading, at their agents, the ranges of `leases` in other engines'
    /// regions that have no registration yet, before a load plans its windows. The
    /// round trips hold the agent's control connection, not the state's lock: a slow
    /// agent holds the loads that read from it, not the handler's other requests.
    /// What is not mapped here (the connection down, a registration forgotten in the
    /// meantime) `locate` maps under the lock.
    pub(super) fn map_reads(&self, leases: &[LeaseGrant]) {
        let (todo, gen) = self.lock().reads_to_map(leases);
        for t in todo {
            let got = {
                let mut link = t.link.lock().unwrap_or_else(|e| e.into_inner());
                map_read_all(&mut link, &t.agent, &t.leases)
            };
            self.lock().mapped_reads(&t.agent, gen, got);
        }
    }
}
