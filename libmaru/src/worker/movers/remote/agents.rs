//! The agents of a remote mover: a control connection each, a probe connection, the
//! transport peer, and what the lifecycle makes of what they say. Every round trip,
//! connect and fence runs without the state's lock, holding only its connection
//! (`link`), by the request's deadline; what it found is recorded under the lock.

use super::link::LinkLease;
use super::state::{agent_link, range, MapReads, ToMap};
use super::RemoteMover;
use crate::net::{Link, LinkError};
use crate::transport::{PeerId, TransportError};
use crate::wire::agent::{AgentReply, AgentRequest, RangeMapped, ReadRange, MAX_READ_RANGES};
use crate::wire::meta::{LeaseGrant, RegionGrant};
use crate::worker::agents::welcome_identity;
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::{Peer, WorkerError};
use crate::worker::lifecycle::{Action, Verdict};
use crate::worker::op_stats::{contacted, Contact};
use std::time::Duration;

/// Timeouts of an agent probe (connect, then the status call): short, since a probe
/// holds the pool's tick.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the tick's fences wait for their proof (see `RemoteMover::reclaim`).
const TICK_FENCE_WAIT: Duration = Duration::from_secs(1);

fn timed_out(agent: &str, what: &str) -> WorkerError {
    WorkerError::unavailable(
        Peer::Agent(agent.to_string()),
        format!("{what} within the request's timeout"),
    )
}

/// A call to `agent` failed with `e`.
fn at(agent: &str, e: LinkError) -> WorkerError {
    WorkerError::from_link(Peer::Agent(agent.to_string()), e)
}

/// `req` on `link`, by `within`: one round trip to its agent (counted for the call
/// this thread runs, see `op_stats::contacted`).
fn ask(link: &mut Link, req: &AgentRequest, within: Duration) -> Result<AgentReply, LinkError> {
    contacted(Contact::Agent);
    link.call_within::<_, AgentReply>(req, within)
}

/// Asks `link`'s agent who it is (boot id, epoch), with an unmap of no region.
fn ping(link: &mut Link, within: Duration) -> Result<(Option<String>, Option<u64>), LinkError> {
    let ping = AgentRequest::Unmap {
        region_id: u64::MAX,
    };
    let was = link.is_connected();
    let mut r = ask(link, &ping, within);
    if r.is_err() && was && !link.is_connected() {
        // The old connection was dead (a restart, say): once more on a fresh one.
        r = ask(link, &ping, within);
    }
    r?;
    link.client().map(|c| welcome_identity(c))
}

/// Asks `link`'s agent to map each of `leases` for reading, all by `by`: one
/// `map_reads` round trip for up to `MAX_READ_RANGES` of them; nothing more after a
/// request broke the connection.
fn map_read_all(link: &mut Link, agent: &str, leases: &[LeaseGrant], by: Deadline) -> MapReads {
    let mut got = MapReads::default();
    for part in leases.chunks(MAX_READ_RANGES) {
        if !link.is_connected() || by.passed() {
            break;
        }
        let ranges = part
            .iter()
            .map(|l| ReadRange {
                region_id: l.region_id,
                offset: l.offset,
                length: l.length,
                read_token: l.read_token.clone(),
            })
            .collect();
        let r = ask(link, &AgentRequest::MapReads { ranges }, by.left());
        got.broke |= !link.is_connected();
        match r {
            Ok(AgentReply::MappedReads { ranges }) if ranges.len() == part.len() => {
                for (l, m) in part.iter().zip(ranges) {
                    match m {
                        RangeMapped::Mapped(m) => got.mapped.push((range(l), m)),
                        // Said to the caller when the window is planned (the range
                        // is not mapped then).
                        RangeMapped::Failed(e) => log::debug!(
                            "agent {agent}: map_reads of region {} at {}: {e}",
                            l.region_id,
                            l.offset
                        ),
                    }
                }
            }
            Ok(other) => log::warn!(
                "agent {agent} answered map_reads of {} ranges with {other:?}",
                part.len()
            ),
            Err(e) => {
                log::debug!("agent {agent}: map_reads of {} ranges: {e}", part.len());
                got.unreachable |= matches!(e, LinkError::Unreachable(_));
            }
        }
    }
    got
}

impl RemoteMover {
    /// Makes the control connection to `addr` if it is down (its connect and
    /// handshake by `by`) and tells the lifecycle who answered.
    fn connect(
        &self,
        addr: &str,
        lease: &mut LinkLease<'_>,
        by: Deadline,
    ) -> Result<(), WorkerError> {
        if lease.refresh() {
            return Ok(());
        }
        let now = now_ms();
        contacted(Contact::Agent);
        let who = lease.client_within(by.left()).map(|c| welcome_identity(c));
        let r = {
            let mut st = self.lock();
            match who {
                Ok((boot, epoch)) => st.seen(addr, boot.as_deref(), epoch, now).map(|_| ()),
                Err(e) => {
                    st.away(addr, now, &format!("a connect: {e}"));
                    Err(at(addr, e))
                }
            }
        };
        if r.is_err() {
            lease.reset();
        }
        self.fence_queued(by);
        r
    }

    /// `req` on `addr`'s control connection, connecting first, all by `by`; once more
    /// on a fresh connection when the old one was found dead.
    fn call(
        &self,
        addr: &str,
        lease: &mut LinkLease<'_>,
        req: &AgentRequest,
        by: Deadline,
    ) -> Result<AgentReply, WorkerError> {
        self.connect(addr, lease, by)?;
        let mut r = ask(lease, req, by.left());
        if !lease.is_connected() {
            self.lock().link_broke(addr);
            if r.is_err() && !by.passed() {
                self.connect(addr, lease, by)?;
                r = ask(lease, req, by.left());
                if !lease.is_connected() {
                    self.lock().link_broke(addr);
                }
            }
        }
        if let Err(LinkError::Unreachable(e)) = &r {
            self.lock().away(addr, now_ms(), &format!("a call: {e}"));
        }
        r.map_err(|e| at(addr, e))
    }

    /// Maps the own regions at `addr` again (a restart keeps the bytes, not the
    /// registrations), unless one waits for maru-server to hear of a reboot.
    fn remap(&self, addr: &str, lease: &mut LinkLease<'_>, by: Deadline) {
        // Connect first: a new connection's welcome may reveal a reboot, and then
        // nothing is mapped before maru-server dropped the keys.
        if let Err(e) = self.connect(addr, lease, by) {
            log::debug!("mapping again at agent {addr}: {e}");
            return;
        }
        let regions: Vec<(u64, crate::wire::rm::Handle)> = {
            let st = self.lock();
            if !st.life.may_map(addr) {
                return;
            }
            st.own
                .iter()
                .filter(|(_, r)| r.agent == addr)
                .map(|(id, r)| (*id, r.handle.clone()))
                .collect()
        };
        let mut all = true;
        for (id, handle) in regions {
            let req = AgentRequest::Map {
                handle,
                writable: true,
            };
            match self.call(addr, lease, &req, by) {
                Ok(AgentReply::Mapped(m)) => {
                    let mut st = self.lock();
                    let v = st.seen(addr, Some(&m.boot_id), None, now_ms());
                    if let Err(e) = &v {
                        log::warn!("region {id}: {e}");
                    }
                    if v != Ok(Verdict::Same) || !st.life.may_map(addr) {
                        all = false;
                        break;
                    }
                    if let Some(r) = st.own.get_mut(&id) {
                        r.map = m;
                    }
                }
                Ok(r) => {
                    log::warn!("region {id}: agent {addr} answered map with {r:?}");
                    all = false;
                }
                Err(e) => {
                    log::debug!("region {id}: mapping again at agent {addr} failed: {e}");
                    all = false;
                    break;
                }
            }
        }
        if all {
            self.lock().life.remapped(addr);
        }
        self.fence_queued(by);
    }

    /// The data connection to `addr` (made now if there is none: on verbs its
    /// queue pairs are brought up over the control connection), by `by`.
    fn peer(
        &self,
        addr: &str,
        lease: &mut LinkLease<'_>,
        by: Deadline,
    ) -> Result<PeerId, WorkerError> {
        let meta = {
            let mut st = self.lock();
            if let Some(p) = st.agent(addr).peer {
                return Ok(p);
            }
            st.transport_of(addr)
        };
        let meta = meta.ok_or_else(|| {
            WorkerError::Transport(format!(
                "agent {addr}: no region mapped there names its NIC"
            ))
        })?;
        self.connect(addr, lease, by)?;
        let mut bringup = |info: &serde_json::Value| -> Result<serde_json::Value, TransportError> {
            let req = AgentRequest::ConnectPeer { info: info.clone() };
            match ask(lease, &req, by.left()) {
                Ok(AgentReply::Peer { info }) => Ok(info),
                Ok(r) => Err(TransportError::Setup(format!("unexpected reply {r:?}"))),
                Err(e) => Err(TransportError::Setup(e.to_string())),
            }
        };
        let p = self
            .nic
            .connect_within(&meta, &mut bringup, by.left())
            .map_err(|e| {
                WorkerError::unavailable(
                    Peer::Agent(addr.to_string()),
                    format!("its data connection: {e}"),
                )
            })?;
        self.lock().agent(addr).peer = Some(p);
        Ok(p)
    }

    /// Gets `addr` ready for a window, by `by`: its control connection up, this
    /// mover's regions there mapped again if that is due, its data connection made.
    pub(super) fn ready(&self, addr: &str, by: Deadline) -> Result<(), WorkerError> {
        let link = self.lock().link_of(addr);
        let mut lease = link
            .take(by)
            .ok_or_else(|| timed_out(addr, "its control connection was not free"))?;
        self.connect(addr, &mut lease, by)?;
        if self.lock().remap_due(addr) {
            self.remap(addr, &mut lease, by);
        }
        self.peer(addr, &mut lease, by).map(|_| ())
    }

    /// Connects to each of `agents` by `by`, so a key that does not prove fails the
    /// open; an agent that does not answer is no error.
    pub(crate) fn greet(&self, agents: &[String], by: Deadline) -> Result<(), WorkerError> {
        for addr in agents {
            let link = self.lock().link_of(addr);
            let Some(mut lease) = link.take(by) else {
                continue;
            };
            match self.connect(addr, &mut lease, by) {
                Err(e @ WorkerError::Auth { .. }) => return Err(e),
                Err(e) => log::warn!("{e}; its regions are mapped when a store takes one"),
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// Maps a region this worker took at its agent and records it, then connects its
    /// peer; every wait by `by`, holding the agent's control connection only.
    pub(crate) fn adopt(&self, grant: &RegionGrant, by: Deadline) -> Result<(), WorkerError> {
        let agent = grant.agent.clone().ok_or_else(|| {
            WorkerError::Config(format!(
                "region {} has no agent: maru-server runs without --remote-cxl-agent",
                grant.handle.region_id
            ))
        })?;
        if self.lock().agent_away(&agent) {
            return Err(WorkerError::unavailable(
                Peer::Agent(agent),
                format!(
                    "region {}: its agent is away (it did not answer): not mapped until it answers again",
                    grant.handle.region_id
                ),
            ));
        }
        let req = AgentRequest::Map {
            handle: grant.handle.clone(),
            writable: true,
        };
        let link = self.lock().link_of(&agent);
        let mut lease = link
            .take(by)
            .ok_or_else(|| timed_out(&agent, "its control connection was not free"))?;
        let reply = self.call(&agent, &mut lease, &req, by)?;
        let adopted = self.lock().adopted(grant, &agent, reply, now_ms());
        self.fence_queued(by);
        adopted?;
        let peer = self.peer(&agent, &mut lease, by);
        if peer.is_err() {
            self.lock().forget_region(grant.handle.region_id);
        }
        peer.map(|_| ())
    }

    /// What is due on the pool's tick: probes (each its own short bound), maps again
    /// and fences of kept slots, by `by` (the pool's tick: what it sends after this
    /// has what is left); returns the regions of agents silent too long, to give back.
    pub(crate) fn tick(&self, now_ms: u64, by: Deadline) -> Vec<u64> {
        let due = self.lock().life.due(now_ms);
        let mut give_back = Vec::new();
        for a in due {
            match a {
                Action::Probe(agent) => self.probe(&agent, now_ms),
                Action::Remap(agent) => self.remap_if_free(&agent, by),
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
        let due = self.lock().remaps_due();
        for agent in due {
            self.remap_if_free(&agent, by);
        }
        // What was not mapped again by `by` stays due: the next tick maps it.
        let fences = by.within(TICK_FENCE_WAIT);
        self.fence_queued(fences);
        self.reclaim(fences);
        give_back
    }

    /// Maps the regions at `agent` again, by `by`, if no request has its connection now.
    fn remap_if_free(&self, agent: &str, by: Deadline) {
        let link = self.lock().link_of(agent);
        let lease = link.try_take();
        if let Some(mut lease) = lease {
            self.remap(agent, &mut lease, by);
        }
    }

    /// Probes the agents that are away and due, and fences peers that keep slots (a
    /// fence that succeeds tells a data connection that answers again).
    pub(crate) fn probe_away(&self, now_ms: u64, by: Deadline) {
        let due = self.lock().life.away_probes_due(now_ms);
        for a in due {
            self.probe(&a, now_ms);
        }
        if !self.lock().iso.to_fence().is_empty() {
            self.reclaim(by.within(TICK_FENCE_WAIT));
        }
    }

    /// Probes the agents of the own regions now.
    pub(crate) fn check_agents(&self, now_ms: u64) {
        let mut agents: Vec<String> = self.lock().own.values().map(|r| r.agent.clone()).collect();
        agents.sort();
        agents.dedup();
        for a in agents {
            self.probe(&a, now_ms);
        }
    }

    /// The probe connection to `addr`, taken out of `probes` for one probe: short
    /// timeouts, a client id of its own (it holds no read handles to drop).
    fn take_probe_link(&self, addr: &str) -> Link {
        let idle = self
            .probes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(addr);
        idle.unwrap_or_else(|| {
            let mut opts = self.agent_opts.clone();
            opts.client_id = format!("{}#probe", opts.client_id);
            opts.connect_timeout = PROBE_TIMEOUT;
            opts.call_timeout = PROBE_TIMEOUT;
            agent_link(addr, opts)
        })
    }

    /// Asks whether `addr` answers, and who, on its probe connection without the
    /// state's lock (`PROBE_TIMEOUT`; an away agent a request's timeout, so a probe is
    /// waiting when it goes on); what it found goes to the lifecycle.
    fn probe(&self, addr: &str, now: u64) {
        let within = if self.lock().life.is_away(addr) {
            self.timeout.max(PROBE_TIMEOUT)
        } else {
            PROBE_TIMEOUT
        };
        let mut link = self.take_probe_link(addr);
        let who = ping(&mut link, within);
        self.probes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(addr.to_string())
            .or_insert(link);
        self.lock().probed(addr, now, who);
    }

    /// Maps for reading the ranges `todo` names (other engines' regions), on their
    /// agents' control connections, by `by`.
    pub(super) fn map_reads(&self, todo: Vec<ToMap>, by: Deadline) {
        for t in todo {
            let Some(mut lease) = t.link.take(by) else {
                log::debug!(
                    "agent {}: no map_reads: its connection was not free in time",
                    t.agent
                );
                continue;
            };
            if let Err(e) = self.connect(&t.agent, &mut lease, by) {
                log::debug!("agent {}: no map_reads: {e}", t.agent);
                continue;
            }
            let got = map_read_all(&mut lease, &t.agent, &t.leases, by);
            self.lock().mapped_reads(&t.agent, got, now_ms());
        }
    }

    /// Fences the peers the state queued (a restart, a reboot, a failed batch), by `by`.
    pub(super) fn fence_queued(&self, by: Deadline) {
        let peers = std::mem::take(&mut self.lock().to_fence);
        self.fence_round(peers, by);
    }

    /// Fences the peers that keep slots or whose WRITEs' outcome is unknown (until
    /// `by`), gives back what a fence that succeeded frees, and forgets those peers.
    pub(super) fn reclaim(&self, by: Deadline) {
        let peers = self.lock().iso.to_fence();
        self.fence_round(peers, by);
    }

    /// Fences `peers` without the lock (each by `by`), records the outcomes, forgets
    /// the peers proven quiet; freed slots go back after the lock is let go.
    pub(super) fn fence_round(&self, peers: Vec<PeerId>, by: Deadline) {
        if peers.is_empty() {
            return;
        }
        let outcomes: Vec<(PeerId, Result<(), TransportError>)> = peers
            .into_iter()
            .map(|p| {
                contacted(Contact::Agent);
                let r = self.nic.fence_within(p, by.left());
                if let Err(e) = &r {
                    log::warn!("fence of peer {} failed: {e}", p.0);
                }
                (p, r)
            })
            .collect();
        let back = {
            let mut st = self.lock();
            let proven: Vec<PeerId> = outcomes
                .iter()
                .filter(|(p, r)| st.iso.record_fence(*p, r))
                .map(|(p, _)| *p)
                .collect();
            st.forget_peers(&proven);
            st.iso.release(&proven)
        };
        drop(back);
    }

    /// Releases every own region at its agent (no keeper will); (released, failed).
    pub(crate) fn release_all(&self) -> (usize, usize) {
        let own: Vec<(String, crate::wire::rm::Handle)> = self
            .lock()
            .own
            .values()
            .map(|r| (r.agent.clone(), r.handle.clone()))
            .collect();
        let (mut released, mut failed) = (0, 0);
        for (agent, handle) in own {
            let id = handle.region_id;
            // Each release its own timeout, outside any request: a dead agent does
            // not leave the regions at live ones unreleased.
            let by = Deadline::after(self.timeout);
            let link = self.lock().link_of(&agent);
            let r = match link.take(by) {
                Some(mut lease) => {
                    self.call(&agent, &mut lease, &AgentRequest::Release { handle }, by)
                }
                None => Err(timed_out(&agent, "its control connection was not free")),
            };
            match r {
                Ok(AgentReply::Released { .. }) => {
                    self.lock().forget_region(id);
                    released += 1;
                }
                Ok(r) => {
                    log::warn!("agent {agent} answered the release of region {id} with {r:?}");
                    failed += 1;
                }
                Err(e) => {
                    log::warn!("agent {agent}: release of region {id} failed: {e}; the agent's sweep deregisters it once the RM forgets the region");
                    failed += 1;
                }
            }
        }
        (released, failed)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests start fake agents on threads
mod tests {
    use super::super::fixtures::{grant, mapped};
    use super::*;
    use crate::net::handshake::ServerHandshake;
    use crate::net::ClientOptions;
    use crate::testing::serve_handshake;
    use crate::wire;
    use crate::worker::movers::remote::RemoteState;
    use std::io::{Read, Write};

    const A: &str = "a:1";

    fn state() -> RemoteState {
        RemoteState::new(ClientOptions::new("test", "t"))
    }

    /// An own region at `A`, its peer connected, a read registration there.
    fn running() -> RemoteState {
        let mut st = state();
        st.adopted(&grant(1, A), A, mapped(1, "boot-1"), 0).unwrap();
        st.agent(A).peer = Some(PeerId(3));
        st.reads
            .insert((7, 0, 8), (A.into(), 0, 1, serde_json::Value::Null));
        st
    }

    #[test]
    fn a_restart_on_the_same_boot_drops_the_peer_and_the_reads_and_maps_again() {
        let mut st = running();
        st.seen(A, Some("boot-1"), Some(1), 0).unwrap();
        assert_eq!(
            st.seen(A, Some("boot-1"), Some(2), 5),
            Ok(Verdict::Restarted)
        );
        assert_eq!(st.agent(A).peer, None, "its data connection went with it");
        assert_eq!(
            st.to_fence,
            vec![PeerId(3)],
            "fenced once the lock is let go"
        );
        assert!(st.reads.is_empty(), "its registrations went with it");
        assert!(
            st.remap_due(A),
            "the regions are mapped again before their next use"
        );
        assert!(st.life.usable(1), "the bytes survived: the keys stay");
        assert_eq!(st.reboots, 0);
    }

    #[test]
    fn a_reboot_puts_the_regions_out_of_use_and_is_counted() {
        let mut st = running();
        assert_eq!(
            st.seen(A, Some("boot-2"), None, 5),
            Ok(Verdict::Rebooted(vec![1]))
        );
        assert_eq!(
            st.reboots, 1,
            "publishes re-checked before it are waited for"
        );
        assert!(!st.life.usable(1));
        assert!(
            !st.remap_due(A),
            "not mapped again before maru-server dropped the keys"
        );
        assert_eq!(st.to_fence, vec![PeerId(3)]);
    }

    #[test]
    fn an_agent_that_reports_no_boot_id_is_unreachable() {
        let mut st = running();
        assert!(matches!(
            st.seen(A, None, None, 5),
            Err(WorkerError::Unavailable { .. })
        ));
        assert!(st.reads.is_empty());
    }

    #[test]
    fn a_lease_written_under_another_boot_is_not_read() {
        let mut st = state();
        st.seen(A, Some("boot-2"), None, 0).unwrap();
        st.reads
            .insert((7, 0, 8), (A.into(), 0, 1, serde_json::Value::Null));
        let lease = |boot: &str| LeaseGrant {
            lease_id: 1,
            region_id: 7,
            offset: 0,
            length: 8,
            read_token: "00".into(),
            agent: Some(A.into()),
            device: None,
            expires_in_ms: 1000,
            boot_id: Some(boot.into()),
        };
        assert!(st.read_target(&lease("boot-2")).is_ok());
        assert!(
            st.read_target(&lease("boot-1")).is_err(),
            "written before a reboot maru-server has not heard of yet"
        );
        let mut unmapped = lease("boot-2");
        unmapped.region_id = 8;
        assert!(
            st.read_target(&unmapped).is_err(),
            "no registration: not read"
        );
    }

    #[test]
    fn a_map_reads_made_on_a_connection_that_broke_is_not_recorded() {
        let mut st = state();
        let m = match mapped(7, "boot-1") {
            AgentReply::Mapped(m) => m,
            _ => unreachable!(),
        };
        st.mapped_reads(
            A,
            MapReads {
                mapped: vec![((7, 0, 8), m.clone())],
                broke: true,
                unreachable: false,
            },
            0,
        );
        assert!(
            st.reads.is_empty(),
            "its registrations went with the connection"
        );
        assert!(st.life.needs_remap(A));
        st.mapped_reads(
            A,
            MapReads {
                mapped: vec![((7, 0, 8), m)],
                ..MapReads::default()
            },
            0,
        );
        assert_eq!(st.reads.len(), 1);
    }

    /// An agent that welcomes with `info` (after a handshake without a key), then
    /// holds the connection until the client goes.
    fn agent_welcoming(info: serde_json::Value) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let spawn = std::thread::Builder::new().spawn(move || {
            for s in l.incoming().flatten() {
                let info = info.clone();
                let _ = std::thread::Builder::new().spawn(move || {
                    let mut s = s;
                    let hs = ServerHandshake::new(crate::wire::agent::SERVICE, None, info);
                    if serve_handshake(&mut s, hs).is_some() {
                        // Held until the client closes it.
                        let _ = s.read(&mut [0u8; 4096]);
                    }
                });
            }
        });
        assert!(spawn.is_ok());
        addr
    }

    /// An agent (no key) that answers every `map_reads` with a mapping of each range
    /// (boot id `b-1`) and records how many ranges each request carried.
    fn agent_mapping_reads() -> (String, std::sync::Arc<std::sync::Mutex<Vec<usize>>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let serve = move |mut s: std::net::TcpStream| {
            let info = serde_json::json!({"boot_id": "b-1", "epoch": 1});
            let hs = ServerHandshake::new(crate::wire::agent::SERVICE, None, info);
            let Some(mut dec) = serve_handshake(&mut s, hs) else {
                return;
            };
            let mut buf = [0u8; 65536];
            loop {
                match dec.next_frame() {
                    Ok(Some(f)) => {
                        let Ok(env) = wire::decode_json::<wire::Envelope<AgentRequest>>(&f.body)
                        else {
                            return;
                        };
                        let AgentRequest::MapReads { ranges } = env.body else {
                            return;
                        };
                        record.lock().unwrap().push(ranges.len());
                        let ranges = ranges
                            .iter()
                            .map(|r| {
                                RangeMapped::Mapped(crate::wire::agent::MapReply {
                                    region_id: r.region_id,
                                    addr: 0x10000,
                                    rkey: 42,
                                    length: r.length,
                                    offset_in_region: r.offset,
                                    transport: serde_json::Value::Null,
                                    boot_id: "b-1".into(),
                                })
                            })
                            .collect();
                        let reply = AgentReply::MappedReads { ranges };
                        let _ = s.write_all(&wire::reply_frame(env.id, Ok(reply)));
                    }
                    Ok(None) => match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => dec.push(&buf[..n]),
                    },
                    Err(_) => return,
                }
            }
        };
        let spawn = std::thread::Builder::new().spawn(move || {
            for st in l.incoming().flatten() {
                let serve = serve.clone();
                let _ = std::thread::Builder::new().spawn(move || serve(st));
            }
        });
        assert!(spawn.is_ok());
        (addr, seen)
    }

    /// All the ranges of a load at one agent go in one `map_reads` (split at
    /// MAX_READ_RANGES), not one request per range: 300 ranges are 2 requests of 256
    /// and 44, and every range answered is recorded. Seen failing with one range to a
    /// request (300 requests).
    #[test]
    fn the_ranges_at_an_agent_are_mapped_in_one_request_per_max_read_ranges() {
        let (addr, seen) = agent_mapping_reads();
        let leases: Vec<LeaseGrant> = (0..300u64)
            .map(|i| LeaseGrant {
                lease_id: i,
                region_id: 7,
                offset: i * 4096,
                length: 4096,
                read_token: "00".into(),
                agent: Some(addr.clone()),
                device: None,
                expires_in_ms: 1000,
                boot_id: Some("b-1".into()),
            })
            .collect();
        let mut link = agent_link(&addr, ClientOptions::new(crate::wire::agent::SERVICE, "t"));
        assert!(link.client().is_ok(), "the fake agent welcomes");
        let by = Deadline::after(Duration::from_secs(10));
        let got = map_read_all(&mut link, &addr, &leases, by);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![MAX_READ_RANGES, 300 - MAX_READ_RANGES]
        );
        assert!(!got.broke && !got.unreachable);
        assert_eq!(got.mapped.len(), 300);
        assert!(got
            .mapped
            .iter()
            .zip(&leases)
            .all(|((r, m), l)| *r == range(l) && m.offset_in_region == l.offset));
    }

    /// Rule (d): a welcome without a boot id is refused by the link itself, before
    /// anything is asked of the agent (and whatever asks next: a map, a peer's
    /// bring-up, a map_reads). Seen failing with the link made without
    /// `require_boot_id` (the connection was taken).
    #[test]
    fn a_welcome_without_a_boot_id_is_refused_by_the_link_itself() {
        let opts = ClientOptions::new(crate::wire::agent::SERVICE, "t");
        let without = agent_welcoming(serde_json::json!({"epoch": 3}));
        let mut link = agent_link(&without, opts.clone());
        match link.client() {
            Err(LinkError::Unreachable(m)) => assert!(m.contains("boot id"), "{m}"),
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a welcome without a boot id was taken"),
        }
        let with = agent_welcoming(serde_json::json!({"boot_id": "b-1", "epoch": 3}));
        let mut link = agent_link(&with, opts);
        let c = link.client().expect("a welcome with a boot id");
        assert_eq!(welcome_identity(c), (Some("b-1".to_string()), Some(3)));
    }
}
