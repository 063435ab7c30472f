//! What moves the bytes of a pool: one-sided transfers through staging slots
//! (`remote_cxl`) or copies through this host's own mapping of the CXL memory (`cxl`).

use super::error::WorkerError;
use super::staging::{SlotPool, StagingSlots};
use super::transfer::{execute, Isolation, PeerBatch, PeerOutcome};
use crate::dax::{self, Mapping};
use crate::net::{ClientOptions, Link};
use crate::transport::{Op, OpKind, PeerId, Transport, TransportError};
use crate::wire::agent::{AgentReply, AgentRequest, MapReply};
use crate::wire::meta::{LeaseGrant, PageGrant, RegionGrant};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A chunk to write into a page.
pub struct WriteItem<'a> {
    pub page: PageGrant,
    pub data: &'a [u8],
}

pub trait Mover: Send {
    /// Makes one of the session's own regions usable (map it).
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError>;
    /// Writes each item into its page; true where the bytes are complete in the region.
    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool>;
    /// Reads each lease's bytes; `None` where the read failed. A failed batch fails
    /// the rest of the request.
    fn read(&mut self, leases: &[LeaseGrant]) -> Vec<Option<Vec<u8>>>;
    /// Boot ids of the session's regions (for heartbeats).
    fn boot_ids(&self) -> BTreeMap<u64, String>;
    /// Gives back slots of transfers whose peer can now be fenced.
    fn reclaim(&mut self) {}
}

// ---------------------------------------------------------------- remote_cxl

struct OwnRegion {
    agent: String,
    map: MapReply,
}

struct AgentConn {
    link: Link,
    peer: Option<PeerId>,
    boot_id: Option<String>,
}

/// `remote_cxl`: WRITE/READ between staging slots and regions of memory nodes.
pub struct RemoteMover {
    nic: Arc<dyn Transport>,
    staging: StagingSlots,
    iso: Isolation,
    agent_opts: ClientOptions,
    agents: HashMap<String, AgentConn>,
    own: HashMap<u64, OwnRegion>,
    /// Read registrations of leased ranges: (region, offset, length) → where.
    reads: HashMap<(u64, u64, u64), ReadTarget>,
    timeout: Duration,
    last_skip_log: Option<Instant>,
}

impl RemoteMover {
    pub fn new(
        nic: Arc<dyn Transport>,
        staging: StagingSlots,
        agent_opts: ClientOptions,
        timeout: Duration,
    ) -> RemoteMover {
        RemoteMover {
            nic,
            staging,
            iso: Isolation::new(),
            agent_opts,
            agents: HashMap::new(),
            own: HashMap::new(),
            reads: HashMap::new(),
            timeout,
            last_skip_log: None,
        }
    }

    fn agent(&mut self, addr: &str) -> &mut AgentConn {
        let opts = self.agent_opts.clone();
        self.agents
            .entry(addr.to_string())
            .or_insert_with(|| AgentConn {
                link: Link::new(addr, opts).with_check(crate::wire::agent::require_boot_id),
                peer: None,
                boot_id: None,
            })
    }

    fn agent_call(&mut self, addr: &str, req: &AgentRequest) -> Result<AgentReply, WorkerError> {
        let conn = self.agent(addr);
        let was = conn.link.is_connected();
        let r = conn.link.call::<_, AgentReply>(req);
        if was && !conn.link.is_connected() {
            // A new connection will be a new peer at the transport too.
            conn.peer = None;
        }
        Ok(r?)
    }

    fn check_boot(&mut self, addr: &str, boot: &str) -> Result<(), WorkerError> {
        let conn = self.agent(addr);
        match &conn.boot_id {
            Some(b) if b != boot => Err(WorkerError::Unavailable(format!(
                "memory node of agent {addr} rebooted (boot id {b} → {boot}): its regions are set aside"
            ))),
            _ => {
                conn.boot_id = Some(boot.to_string());
                Ok(())
            }
        }
    }

    fn peer(&mut self, addr: &str, meta: &serde_json::Value) -> Result<PeerId, WorkerError> {
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

    /// Forgets the peers that isolation fenced.
    fn forget_peers(&mut self, fenced: &[PeerId]) {
        for c in self.agents.values_mut() {
            if c.peer.is_some_and(|p| fenced.contains(&p)) {
                c.peer = None;
            }
        }
    }

    fn log_skip(&mut self, n: usize) {
        let now = Instant::now();
        if self
            .last_skip_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60))
        {
            log::warn!(
                "store staging is full: skipping {n} chunk(s) (logged at most once a minute)"
            );
            self.last_skip_log = Some(now);
        }
    }

    fn run(&mut self, batches: Vec<PeerBatch>) -> Vec<PeerOutcome> {
        let out = execute(self.nic.as_ref(), batches, self.timeout, &self.iso);
        if out.iter().any(|o| matches!(o, PeerOutcome::Kept(_))) {
            self.reclaim();
        }
        out
    }
}

impl Mover for RemoteMover {
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        let agent = grant.agent.clone().ok_or_else(|| {
            WorkerError::Config(format!(
                "region {} has no agent: maru-server runs without --remote-cxl-agent",
                grant.handle.region_id
            ))
        })?;
        let m = match self.agent_call(
            &agent,
            &AgentRequest::Map {
                handle: grant.handle.clone(),
                writable: true,
            },
        )? {
            AgentReply::Mapped(m) => m,
            r => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} answered map with {r:?}"
                )))
            }
        };
        if m.boot_id.is_empty() {
            return Err(WorkerError::Unavailable(format!(
                "agent {agent} reports no boot id"
            )));
        }
        self.check_boot(&agent, &m.boot_id)?;
        self.peer(&agent, &m.transport)?;
        self.own
            .insert(grant.handle.region_id, OwnRegion { agent, map: m });
        Ok(())
    }

    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool> {
        let mut ok = vec![false; items.len()];
        let mut next = 0;
        // Rounds of as many chunks as there are free store slots; a round's slots come
        // back when its WRITEs completed. With no free slot at all, the rest is skipped.
        while next < items.len() {
            let mut slots = self
                .staging
                .try_acquire(SlotPool::Store, items.len() - next);
            if slots.is_empty() {
                self.log_skip(items.len() - next);
                break;
            }
            let end = next + slots.len();
            let mut group = PeerGroups::default();
            for (i, it) in items.iter().enumerate().take(end).skip(next) {
                let Some(region) = self.own.get(&it.page.region_id) else {
                    continue;
                };
                let (agent, addr, rkey, meta) = (
                    region.agent.clone(),
                    region.map.addr,
                    region.map.rkey,
                    region.map.transport.clone(),
                );
                let Ok(peer) = self.peer(&agent, &meta) else {
                    continue;
                };
                if it.data.len() > self.staging.layout().slot_size {
                    continue;
                }
                let Some(mut slot) = slots.pop() else { break };
                slot.bytes_mut()[..it.data.len()].copy_from_slice(it.data);
                let op = Op {
                    kind: OpKind::Write,
                    local_offset: slot.offset() as u64,
                    remote_addr: addr + it.page.offset,
                    rkey,
                    len: it.data.len() as u64,
                };
                group.add(peer, op, slot, i);
            }
            drop(slots);
            let order = group.order;
            for (bi, out) in self.run(group.batches).into_iter().enumerate() {
                if out.is_done() {
                    for &i in &order[bi] {
                        ok[i] = true;
                    }
                }
            }
            next = end;
        }
        ok
    }

    fn read(&mut self, leases: &[LeaseGrant]) -> Vec<Option<Vec<u8>>> {
        let mut out: Vec<Option<Vec<u8>>> = vec![None; leases.len()];
        let mut next = 0;
        while next < leases.len() {
            // A batch fits the free load slots (waiting up to 1 s for one).
            let mut slots =
                self.staging
                    .acquire(SlotPool::Load, leases.len() - next, Duration::from_secs(1));
            if slots.is_empty() {
                log::warn!(
                    "no load slot free within 1 s: {} chunk(s) not loaded",
                    leases.len() - next
                );
                return out;
            }
            let mut group = PeerGroups::default();
            let end = next + slots.len();
            for (i, l) in leases.iter().enumerate().take(end).skip(next) {
                let Ok((agent, addr, rkey, meta)) = self.read_target(l) else {
                    continue;
                };
                let Ok(peer) = self.peer(&agent, &meta) else {
                    continue;
                };
                if l.length as usize > self.staging.layout().slot_size {
                    continue;
                }
                let Some(slot) = slots.pop() else { break };
                let op = Op {
                    kind: OpKind::Read,
                    local_offset: slot.offset() as u64,
                    remote_addr: addr,
                    rkey,
                    len: l.length,
                };
                group.add(peer, op, slot, i);
            }
            let (batches, order) = (group.batches, group.order);
            let mut failed = false;
            for (bi, o) in self.run(batches).into_iter().enumerate() {
                match o {
                    PeerOutcome::Done(slots) => {
                        for (k, slot) in slots.iter().enumerate() {
                            let i = order[bi][k];
                            out[i] = Some(slot.bytes()[..leases[i].length as usize].to_vec());
                        }
                    }
                    _ => failed = true,
                }
            }
            if failed {
                // A failed batch fails the request from that batch on; read
                // registrations may have gone with their region, so map again next time.
                self.reads.clear();
                return out;
            }
            next = end;
        }
        out
    }

    fn boot_ids(&self) -> BTreeMap<u64, String> {
        self.own
            .iter()
            .map(|(id, r)| (*id, r.map.boot_id.clone()))
            .collect()
    }

    fn reclaim(&mut self) {
        let fenced = self.iso.reclaim(self.nic.as_ref());
        if !fenced.is_empty() {
            self.forget_peers(&fenced);
        }
    }
}

/// A remote range to READ: its agent, address, key and transport metadata.
type ReadTarget = (String, u64, u64, serde_json::Value);

/// Operations grouped into one batch per peer, remembering which item each came from.
#[derive(Default)]
struct PeerGroups {
    batches: Vec<PeerBatch>,
    order: Vec<Vec<usize>>,
}

impl PeerGroups {
    fn add(&mut self, peer: PeerId, op: Op, slot: super::staging::Slot, item: usize) {
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

impl RemoteMover {
    /// Where a lease's bytes are: our own mapping, or a read registration at its agent.
    fn read_target(&mut self, l: &LeaseGrant) -> Result<ReadTarget, WorkerError> {
        if let Some(r) = self.own.get(&l.region_id) {
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
        let m = match self.agent_call(&agent, &req)? {
            AgentReply::Mapped(m) => m,
            r => {
                return Err(WorkerError::Transport(format!(
                    "agent {agent} answered map_read with {r:?}"
                )))
            }
        };
        self.check_boot(&agent, &m.boot_id)?;
        let t = (agent, m.addr, m.rkey, m.transport);
        self.reads
            .insert((l.region_id, l.offset, l.length), t.clone());
        Ok(t)
    }
}

// ---------------------------------------------------------------- cxl

/// `cxl`: this host maps the regions itself and copies with memcpy.
pub struct CxlMover {
    own: HashMap<u64, Mapping>,
    readers: HashMap<u64, Mapping>,
}

impl CxlMover {
    pub fn new() -> CxlMover {
        CxlMover {
            own: HashMap::new(),
            readers: HashMap::new(),
        }
    }
}

impl Default for CxlMover {
    fn default() -> Self {
        CxlMover::new()
    }
}

fn local_path(uuid: &str, path: &str) -> Result<String, WorkerError> {
    match dax::scan_uuid(path) {
        Ok(Some(u)) if u == uuid => Ok(path.to_string()),
        Ok(_) => Err(WorkerError::Config(format!("device {path} here is not the pool's device (uuid {uuid}): is this host attached to that CXL memory?"))),
        Err(e) => Err(WorkerError::Config(format!("{e}: backend cxl needs the pool's device on this host"))),
    }
}

impl Mover for CxlMover {
    fn adopt(&mut self, grant: &RegionGrant) -> Result<(), WorkerError> {
        let path = local_path(&grant.pool.uuid, &grant.pool.path)?;
        let h = &grant.handle;
        let m = dax::map_range(
            &path,
            dax::kind_of_path(&path),
            h.offset,
            h.length,
            grant.pool.align,
            true,
        )
        .map_err(|e| WorkerError::Config(e.to_string()))?;
        self.own.insert(h.region_id, m);
        Ok(())
    }

    fn write(&mut self, items: &[WriteItem<'_>]) -> Vec<bool> {
        items
            .iter()
            .map(|it| {
                let Some(m) = self.own.get_mut(&it.page.region_id) else {
                    return false;
                };
                let Ok(bytes) = m.as_mut_slice() else {
                    return false;
                };
                let (o, n) = (it.page.offset as usize, it.data.len());
                match bytes.get_mut(o..o + n) {
                    Some(dst) => {
                        dst.copy_from_slice(it.data);
                        true
                    }
                    None => false,
                }
            })
            .collect()
    }

    fn read(&mut self, leases: &[LeaseGrant]) -> Vec<Option<Vec<u8>>> {
        leases
            .iter()
            .map(|l| {
                if !self.own.contains_key(&l.region_id) && !self.readers.contains_key(&l.region_id)
                {
                    let d = l.device.as_ref()?;
                    let path = local_path(&d.uuid, &d.path).ok()?;
                    let m = dax::map_range(
                        &path,
                        dax::kind_of_path(&path),
                        d.region_offset,
                        d.region_length,
                        2 << 20,
                        false,
                    )
                    .ok()?;
                    self.readers.insert(l.region_id, m);
                }
                let m = self
                    .own
                    .get(&l.region_id)
                    .or_else(|| self.readers.get(&l.region_id))?;
                let bytes = m.as_slice().ok()?;
                bytes
                    .get(l.offset as usize..(l.offset + l.length) as usize)
                    .map(<[u8]>::to_vec)
            })
            .collect()
    }

    fn boot_ids(&self) -> BTreeMap<u64, String> {
        BTreeMap::new()
    }
}
