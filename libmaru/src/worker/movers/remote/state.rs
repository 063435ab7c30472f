//! The remote state's rules: which agent is known, away or ready, what a welcome, a
//! probe's answer or a failed batch makes of it, where a lease's bytes are, which
//! ranges are to be mapped for reading; and a window's plan (one batch per peer) and
//! settlement (a peer whose batch failed is dropped and fenced, one whose batch did
//! not finish keeps its slots: `isolation`). No socket: the round trips that feed
//! these rules are `agents.rs`'s and `windows.rs`'s, made without the lock.

use super::isolation::{PeerBatch, PeerOutcome};
use super::link::AgentLink;
use super::{AgentConn, OwnRegion, ReadTarget, RemoteState, WriteTo};
use crate::net::{Link, LinkError};
use crate::transport::{Op, OpKind, PeerId, TransportError};
use crate::wire::agent::{AgentReply, MapReply};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use crate::worker::agents::require_boot_id;
use crate::worker::error::{Peer, WorkerError};
use crate::worker::lifecycle::Verdict;
use crate::worker::movers::SlotOutcome;
use crate::worker::staging::Slot;
use std::sync::Arc;

/// A control link to an agent; one whose welcome has no boot id is refused by it.
pub(super) fn agent_link(addr: &str, opts: crate::net::ClientOptions) -> Link {
    Link::new(addr, opts).with_check(require_boot_id)
}

/// A lease's range: (region, offset, length).
pub(super) fn range(l: &LeaseGrant) -> (u64, u64, u64) {
    (l.region_id, l.offset, l.length)
}

/// Ranges to map for reading at one agent.
pub(super) struct ToMap {
    pub(super) agent: String,
    pub(super) link: Arc<AgentLink>,
    pub(super) leases: Vec<LeaseGrant>,
}

/// What the `map_reads` requests on one connection got.
#[derive(Default)]
pub(super) struct MapReads {
    pub(super) mapped: Vec<((u64, u64, u64), MapReply)>,
    /// The connection broke on the way (what was mapped on it is gone).
    pub(super) broke: bool,
    /// The agent did not answer (the outcome of the call is unknown).
    pub(super) unreachable: bool,
}

impl RemoteState {
    pub(super) fn agent(&mut self, addr: &str) -> &mut AgentConn {
        let opts = self.agent_opts.clone();
        self.agents
            .entry(addr.to_string())
            .or_insert_with(|| AgentConn {
                link: Arc::new(AgentLink::new(agent_link(addr, opts))),
                peer: None,
            })
    }

    /// The control connection of `addr` (known to the pool from now on).
    pub(crate) fn link_of(&mut self, addr: &str) -> Arc<AgentLink> {
        self.agent(addr).link.clone()
    }

    /// An agent said who it is (a welcome, a probe's answer, a map reply): the
    /// lifecycle's verdict, carried out (`on_verdict`).
    pub(crate) fn seen(
        &mut self,
        addr: &str,
        boot: Option<&str>,
        epoch: Option<u64>,
        now_ms: u64,
    ) -> Result<Verdict, WorkerError> {
        let was_away = self.life.is_away(addr);
        let v = self.life.seen(addr, boot, epoch, now_ms);
        if was_away && !self.life.is_away(addr) {
            log::warn!(
                "agent {addr} answers again: stores into its regions and loads from it go on"
            );
        }
        self.on_verdict(addr, v.clone()).map(|()| v)
    }

    /// `addr` did not answer a request's call by its deadline (`why`): away until it
    /// answers again (`Lifecycle::missed_deadline`); said once per absence.
    pub(crate) fn away(&mut self, addr: &str, now_ms: u64, why: &str) {
        if self.life.missed_deadline(addr, now_ms) {
            log::warn!(
                "agent {addr} did not answer ({why}): stores into its regions are skipped and loads from it miss, at once, until a probe (every {} ms) sees it answer; its regions go back to maru-server if it stays silent {} s",
                crate::worker::lifecycle::AWAY_PROBE_EVERY_MS,
                crate::worker::lifecycle::AGENT_SILENCE_MS / 1000
            );
        }
    }

    /// Whether `agent` is away (`Lifecycle::is_away`), or its data connection keeps
    /// slots that no fence freed yet (the control port may answer while the data
    /// path does not).
    pub(crate) fn agent_away(&self, agent: &str) -> bool {
        self.life.is_away(agent)
            || self
                .agents
                .get(agent)
                .and_then(|c| c.peer)
                .is_some_and(|p| self.iso.holds(p))
    }

    /// Whether own region `region` is at an agent that is away.
    pub(crate) fn region_away(&self, region: u64) -> bool {
        self.own
            .get(&region)
            .is_some_and(|r| self.agent_away(&r.agent))
    }

    /// Whether every agent the pool knows (from the handshake, or stored or read at)
    /// is away.
    pub(crate) fn every_agent_away(&self) -> bool {
        !self.agents.is_empty() && self.agents.keys().all(|a| self.agent_away(a))
    }

    /// Whether a lease's bytes are at an agent that is away.
    pub(crate) fn lease_away(&self, l: &LeaseGrant) -> bool {
        let agent = match self.own.get(&l.region_id) {
            Some(r) => Some(r.agent.as_str()),
            None => l.agent.as_deref(),
        };
        agent.is_some_and(|a| self.agent_away(a))
    }

    /// Carries out a verdict: a restart or a reboot drops the peer (to be fenced) and
    /// the read registrations; no boot id: the control connection goes.
    pub(super) fn on_verdict(&mut self, addr: &str, v: Verdict) -> Result<(), WorkerError> {
        match v {
            Verdict::Same => return Ok(()),
            Verdict::NoBoot => {
                self.agent(addr).link.reset_later();
                // Read registrations go with the connection.
                self.forget_reads(Some(addr));
                return Err(WorkerError::unavailable(
                    Peer::Agent(addr.to_string()),
                    "it reports no boot id: treated as unreachable",
                ));
            }
            Verdict::Restarted => log::info!(
                "agent {addr} restarted (same boot): mapping this worker's regions there again"
            ),
            Verdict::Rebooted(ids) => {
                // Publishes re-checked before this are answered before it is reported.
                self.reboots += 1;
                log::warn!(
                    "the memory node of agent {addr} rebooted (new boot id): the keys of region(s) {ids:?} died with it; maru-server is told before they are used again"
                )
            }
        }
        // Its registrations and data connection are gone with the old process.
        if let Some(p) = self.agent(addr).peer.take() {
            self.to_fence.push(p);
        }
        self.forget_reads(Some(addr));
        Ok(())
    }

    /// The control connection to `addr` broke: its peer and read registrations go,
    /// and the own regions there are mapped again before their next use.
    pub(super) fn link_broke(&mut self, addr: &str) {
        self.agent(addr).peer = None;
        self.life.link_broken(addr);
        self.forget_reads(Some(addr));
    }

    /// What a probe of `addr` found out (`who`: the boot id and epoch that answered).
    pub(super) fn probed(
        &mut self,
        addr: &str,
        now: u64,
        who: Result<(Option<String>, Option<u64>), LinkError>,
    ) {
        match who {
            Ok((boot, epoch)) => {
                let v = self.seen(addr, boot.as_deref(), epoch, now);
                if v != Ok(Verdict::Same) {
                    // The control connection went with the old process: the next
                    // call connects afresh (and its welcome is checked again).
                    self.agent(addr).link.reset_later();
                }
                if let Err(e) = v {
                    log::warn!("{e}");
                }
            }
            Err(e) => {
                match crate::worker::warn_limit::allow(addr, "agent_silent") {
                    Some(n) => log::warn!(
                        "agent {addr} did not answer a probe ({e}); its regions go back to maru-server if it stays silent {} s{}",
                        crate::worker::lifecycle::AGENT_SILENCE_MS / 1000,
                        crate::worker::warn_limit::held_back(n)
                    ),
                    None => log::debug!("agent {addr} did not answer a probe: {e}"),
                }
                self.life.unreachable(addr, now);
            }
        }
    }

    /// A peer whose batch failed with a known outcome: forgotten and queued to be
    /// fenced; its agent's regions are mapped again before their next use.
    pub(crate) fn drop_failed_peer(&mut self, peer: PeerId) {
        let mut dropped = false;
        for (addr, c) in self.agents.iter_mut() {
            if c.peer == Some(peer) {
                c.peer = None;
                // The agent's control connection likely went with it (a restart):
                // connect afresh rather than find out on the next call.
                c.link.reset_later();
                self.life.link_broken(addr);
                dropped = true;
            }
        }
        // A closed control connection takes its read registrations with it.
        if dropped {
            self.forget_reads(None);
        }
        self.to_fence.push(peer);
    }

    /// Whether this mover's regions at `agent` are to be mapped again now.
    pub(super) fn remap_due(&self, agent: &str) -> bool {
        self.life.needs_remap(agent)
            && self.life.may_map(agent)
            && self.own.values().any(|r| r.agent == agent)
    }

    /// The agents whose regions are to be mapped again now, and that answer.
    pub(super) fn remaps_due(&self) -> Vec<String> {
        let mut agents: Vec<String> = self
            .own
            .values()
            .map(|r| r.agent.clone())
            .filter(|a| self.remap_due(a))
            .collect();
        agents.sort();
        agents.dedup();
        agents
    }

    /// The transport metadata to reach `agent`'s NIC with (its newest map reply).
    pub(super) fn transport_of(&self, agent: &str) -> Option<serde_json::Value> {
        self.own
            .values()
            .find(|r| r.agent == agent)
            .map(|r| r.map.transport.clone())
            .or_else(|| {
                self.reads
                    .values()
                    .find(|t| t.0 == agent)
                    .map(|t| t.3.clone())
            })
    }

    /// Of `agents`, those to make ready first (`RemoteMover::ready`).
    pub(super) fn unready(&mut self, agents: impl IntoIterator<Item = String>) -> Vec<String> {
        let mut out: Vec<String> = agents
            .into_iter()
            .filter(|a| !self.agent_away(a) && (self.agent(a).peer.is_none() || self.remap_due(a)))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Forgets the peers that isolation fenced.
    pub(super) fn forget_peers(&mut self, fenced: &[PeerId]) {
        for c in self.agents.values_mut() {
            if c.peer.is_some_and(|p| fenced.contains(&p)) {
                c.peer = None;
            }
        }
    }

    /// Where a lease's bytes are, if they may be read (their agent not away, and on
    /// the boot the key was written under).
    pub(super) fn read_target(&mut self, l: &LeaseGrant) -> Result<ReadTarget, WorkerError> {
        if self.lease_away(l) {
            return Err(WorkerError::unavailable(
                Peer::Agent(l.agent.clone().unwrap_or_default()),
                format!(
                    "region {}: its agent is away (it did not answer): a miss until it answers again",
                    l.region_id
                ),
            ));
        }
        let t = self.locate(l)?;
        if !self.life.lease_readable(&t.0, l.boot_id.as_deref()) {
            return Err(WorkerError::unavailable(
                Peer::Agent(t.0.clone()),
                format!(
                    "region {}: written under boot id {}, which the agent no longer runs (the memory node rebooted): nothing is read",
                    l.region_id,
                    l.boot_id.as_deref().unwrap_or("?"),
                ),
            ));
        }
        Ok(t)
    }

    /// Where a lease's bytes are: our own mapping, or a read registration at its agent
    /// (made by `RemoteMover::map_reads`, without the lock).
    fn locate(&mut self, l: &LeaseGrant) -> Result<ReadTarget, WorkerError> {
        if let Some(r) = self.own.get(&l.region_id) {
            if !self.life.usable(l.region_id) {
                return Err(WorkerError::unavailable(
                    Peer::Agent(r.agent.clone()),
                    format!(
                        "region {}: its memory node rebooted; its keys are being dropped",
                        l.region_id
                    ),
                ));
            }
            return Ok((
                r.agent.clone(),
                r.map.addr + l.offset,
                r.map.rkey,
                r.map.transport.clone(),
            ));
        }
        if let Some(t) = self.reads.get(&range(l)) {
            return Ok(t.clone());
        }
        Err(WorkerError::Transport(format!(
            "region {} at agent {}: the range is not mapped for reading (its map_reads refused it or did not answer in time)",
            l.region_id,
            l.agent.as_deref().unwrap_or("?")
        )))
    }

    /// Forgets the read registrations at `agent` (at every agent: None): the agent
    /// dropped them with a connection of this client, or a read failed.
    pub(super) fn forget_reads(&mut self, agent: Option<&str>) {
        match agent {
            Some(a) => self.reads.retain(|_, t| t.0 != a),
            None => self.reads.clear(),
        }
    }

    /// The ranges of `leases` in other engines' regions that have no read
    /// registration yet, by agent, each with the connection to ask on.
    pub(super) fn reads_to_map(&mut self, leases: &[LeaseGrant]) -> Vec<ToMap> {
        let mut out: Vec<ToMap> = Vec::new();
        for l in leases {
            if self.own.contains_key(&l.region_id) || self.reads.contains_key(&range(l)) {
                continue;
            }
            // No agent named: `locate` says so when the window is planned. An agent
            // away is not asked (`read_target` says so).
            let Some(agent) = l.agent.as_deref().filter(|a| !self.agent_away(a)) else {
                continue;
            };
            let at = match out.iter().position(|t| t.agent == agent) {
                Some(at) => at,
                None => {
                    let link = self.link_of(agent);
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
        out
    }

    /// Records what `map_reads` requests made without the lock got at `agent` (nothing
    /// when the connection broke on the way).
    pub(super) fn mapped_reads(&mut self, agent: &str, got: MapReads, now_ms: u64) {
        if got.broke {
            self.link_broke(agent);
        }
        if got.unreachable {
            self.away(agent, now_ms, "a map_reads within the request's timeout");
        }
        for (l, m) in got.mapped {
            if let Err(e) = self.seen(agent, Some(&m.boot_id), None, now_ms) {
                log::warn!("region {}: {e}", l.0);
                return;
            }
            if !got.broke {
                self.reads
                    .insert(l, (agent.to_string(), m.addr, m.rkey, m.transport));
            }
        }
    }

    /// Records a region taken, mapped at its agent (`reply` to the map); returns the
    /// transport metadata of its NIC.
    pub(crate) fn adopted(
        &mut self,
        grant: &RegionGrant,
        agent: &str,
        reply: AgentReply,
        now_ms: u64,
    ) -> Result<serde_json::Value, WorkerError> {
        let m = match reply {
            AgentReply::Mapped(m) => m,
            r => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} answered map with {r:?}"
                )))
            }
        };
        let v = self
            .life
            .adopt(grant.handle.region_id, agent, &m.boot_id, None, now_ms);
        self.on_verdict(agent, v)?;
        let meta = m.transport.clone();
        self.own.insert(
            grant.handle.region_id,
            OwnRegion {
                agent: agent.to_string(),
                handle: grant.handle.clone(),
                map: m,
            },
        );
        Ok(meta)
    }
}

/// One window planned under the state's lock, to post without it (`launch`).
pub(super) struct Planned {
    pub(super) items: Vec<usize>,
    pub(super) out: Vec<SlotOutcome>,
    pub(super) group: PeerGroups,
    pub(super) reads: bool,
}

/// Operations grouped into one batch per peer, remembering which item each came from.
#[derive(Default)]
pub(super) struct PeerGroups {
    pub(super) batches: Vec<PeerBatch>,
    pub(super) order: Vec<Vec<usize>>,
}

impl PeerGroups {
    pub(super) fn add(&mut self, peer: PeerId, op: Op, slot: Slot, item: usize) {
        let bi = match self.batches.iter().position(|b| b.peer == peer) {
            Some(bi) => bi,
            None => {
                self.batches.push(PeerBatch {
                    peer,
                    ops: Vec::new(),
                    slots: Vec::new(),
                });
                self.order.push(Vec::new());
                self.batches.len() - 1
            }
        };
        self.batches[bi].ops.push(op);
        self.batches[bi].slots.push(slot);
        self.order[bi].push(item);
    }
}

/// What settling a window found.
#[derive(Default)]
pub(super) struct Settled {
    /// A batch did not complete.
    pub(super) failed: bool,
    /// A batch failed with a known outcome (its peer dropped: a new try may succeed).
    pub(super) dropped: bool,
    /// A batch's outcome is unknown (its slots are kept until its peer is fenced).
    pub(super) kept: bool,
}

impl Planned {
    /// A window that posts nothing: every slot comes back, no item done.
    pub(super) fn nothing(items: Vec<usize>, slots: Vec<Slot>, reads: bool) -> Planned {
        Planned {
            items,
            out: slots
                .into_iter()
                .map(|s| SlotOutcome {
                    ok: false,
                    slot: Some(s),
                })
                .collect(),
            group: PeerGroups::default(),
            reads,
        }
    }
}

impl RemoteState {
    /// Records each item's outcome of a group that was waited for in `out` (the slot
    /// back unless its peer's outcome is unknown).
    pub(super) fn settle(
        &mut self,
        order: &[Vec<usize>],
        peers: Vec<PeerId>,
        writes: bool,
        outcomes: Vec<PeerOutcome>,
        out: &mut [SlotOutcome],
    ) -> Settled {
        let mut any_failed = false;
        let mut dropped = false;
        let mut any_kept = false;
        for ((items, o), peer) in order.iter().zip(outcomes).zip(peers) {
            let (ok, slots) = match o {
                PeerOutcome::Done(s) => (true, s),
                PeerOutcome::Failed(e, s) => {
                    log::debug!("transfer batch failed: {e}");
                    if writes && matches!(e, TransportError::PeerLost { .. }) {
                        // Locally it is over, but the target may still apply WRITEs
                        // it read: their pages wait for a fence that succeeds.
                        self.iso.unknown_writes(peer);
                    }
                    // Nothing of it is in flight: drop the peer (fenced); the next
                    // transfer connects and maps again (this one tries once more).
                    self.drop_failed_peer(peer);
                    dropped = true;
                    (false, s)
                }
                PeerOutcome::Kept(p, slots) => {
                    // Its agent is away until a fence of p succeeds (`agent_away`).
                    match self.agent_of_peer(p) {
                        Some(agent) if !self.agent_away(&agent) => log::warn!(
                            "agent {agent}: a transfer did not finish by the request's deadline: stores into its regions are skipped and loads from it miss, at once, until a fence of its data connection succeeds (tried every {} ms)",
                            crate::worker::lifecycle::AWAY_PROBE_EVERY_MS
                        ),
                        _ => {}
                    }
                    // The NIC may still move bytes into them: kept until p is fenced.
                    self.iso.keep(p, slots);
                    any_kept = true;
                    (false, Vec::new())
                }
            };
            any_failed |= !ok;
            for (&i, slot) in items.iter().zip(slots) {
                out[i] = SlotOutcome {
                    ok,
                    slot: Some(slot),
                };
            }
        }
        Settled {
            failed: any_failed,
            dropped,
            kept: any_kept,
        }
    }

    /// The agents of the own regions of `items`' pages (`page(item)`).
    pub(super) fn agents_of_pages(
        &self,
        items: &[usize],
        page: &dyn Fn(usize) -> (PageGrant, usize),
    ) -> Vec<String> {
        items
            .iter()
            .filter_map(|&i| self.own.get(&page(i).0.region_id))
            .map(|r| r.agent.clone())
            .collect()
    }

    /// The agents `leases` are read from (an own region's, else the one maru-server named).
    pub(super) fn agents_of_leases(&self, items: &[usize], leases: &[LeaseGrant]) -> Vec<String> {
        items
            .iter()
            .filter_map(|&i| {
                let l = &leases[i];
                match self.own.get(&l.region_id) {
                    Some(r) => Some(r.agent.clone()),
                    None => l.agent.clone(),
                }
            })
            .collect()
    }

    /// The agent `peer` is the data connection of.
    fn agent_of_peer(&self, peer: PeerId) -> Option<String> {
        self.agents
            .iter()
            .find(|(_, c)| c.peer == Some(peer))
            .map(|(a, _)| a.clone())
    }

    /// The peer of `agent`, if it is connected.
    fn peer_of(&self, agent: &str) -> Option<PeerId> {
        self.agents.get(agent).and_then(|c| c.peer)
    }

    /// Where WRITEs into own region `region` go now: none when it is not usable, or its
    /// agent is away, has no data connection or is to be mapped again.
    pub(crate) fn write_to(&self, region: u64) -> Option<WriteTo> {
        let r = self.own.get(&region)?;
        if !self.life.usable(region) || self.agent_away(&r.agent) || self.life.needs_remap(&r.agent)
        {
            return None;
        }
        let peer = self.peer_of(&r.agent)?;
        Some(WriteTo {
            peer,
            addr: r.map.addr,
            rkey: r.map.rkey,
        })
    }

    /// Plans a READ of each of the request's `items` (its lease in `leases`, the
    /// request's) into the slot of the same index.
    pub(super) fn post_reads(
        &mut self,
        items: Vec<usize>,
        leases: &[LeaseGrant],
        slots: Vec<Slot>,
    ) -> Planned {
        let mut out: Vec<SlotOutcome> = Vec::with_capacity(slots.len());
        let mut group = PeerGroups::default();
        for (i, (&item, slot)) in items.iter().zip(slots).enumerate() {
            let l = &leases[item];
            out.push(SlotOutcome {
                ok: false,
                slot: None,
            });
            let peer = match self.read_target(l) {
                Ok((agent, addr, rkey, _)) if l.length as usize <= slot.len() => {
                    match self.peer_of(&agent) {
                        Some(p) => Some((p, addr, rkey)),
                        None => {
                            self.read_error = Some(format!(
                                "agent {agent}: no data connection (it did not answer in time)"
                            ));
                            None
                        }
                    }
                }
                Ok(_) => None,
                Err(e) => {
                    // Said once per request, not per chunk.
                    if self.read_error.is_none() {
                        log::warn!("load of {} bytes of region {}: {e}", l.length, l.region_id);
                    }
                    self.read_error = Some(e.to_string());
                    None
                }
            };
            let Some((peer, addr, rkey)) = peer else {
                out[i].slot = Some(slot);
                continue;
            };
            let op = Op {
                kind: OpKind::Read,
                local_offset: slot.offset() as u64,
                remote_addr: addr,
                rkey,
                len: l.length,
            };
            group.add(peer, op, slot, i);
        }
        Planned {
            items,
            out,
            group,
            reads: true,
        }
    }
}
