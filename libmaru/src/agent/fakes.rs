//! Fake ports for the agent's tests: they record every call, keep the state a real
//! RM, memory and NIC would keep, and fail on demand.
//!
//! The fakes reproduce the two behaviours the agent's rules guard against: memory
//! reuses the addresses of an unmapped range (as mmap does), and the NIC hands out
//! the same key when the same range is registered again.

use super::ports::{MappedRange, MemPort, NicPort, Registration, RmCallError, RmPort};
use super::AgentCore;
use crate::auth::read_token;
use crate::wire::agent::{AgentReply, AgentRequest, MapReply, RangeMapped, ReadRange};
use crate::wire::rm::{AccessReply, Handle};
use crate::wire::{ErrorCode, WireError};
use std::collections::{BTreeMap, BTreeSet};

pub const NODE: &str = "mem1";
pub const EPOCH: u64 = 7;
pub const BOOT: &str = "boot-1";
pub const Q_MS: u64 = 600_000;
pub const LEN: u64 = 2 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionState {
    Allocated,
    /// Freed while held: GET_ACCESS and HOLD are refused, UNHOLD works.
    Draining,
}

/// A resource manager for one agent (holds are per region: one node, one epoch).
#[derive(Debug, Default)]
pub struct FakeRm {
    pub regions: BTreeMap<u64, (Handle, RegionState)>,
    pub held: BTreeSet<u64>,
    pub calls: Vec<String>,
    /// Every call fails and does nothing (the RM is away).
    pub down: bool,
    /// HOLD takes effect but its reply is lost.
    pub lose_hold_reply: bool,
    /// UNHOLD fails and does nothing (the RM cannot save its state).
    pub fail_unhold: bool,
    /// UNHOLD is refused (the RM holds nothing of that region for this node).
    pub refuse_unhold: bool,
    pub resets: usize,
    next_id: u64,
}

impl FakeRm {
    pub fn region(&mut self) -> Handle {
        self.next_id += 1;
        let id = self.next_id;
        let h = crate::rm::fake_handle(id, LEN);
        self.regions.insert(id, (h.clone(), RegionState::Allocated));
        h
    }

    pub fn drain(&mut self, id: u64) {
        if let Some(r) = self.regions.get_mut(&id) {
            r.1 = RegionState::Draining;
        }
    }

    fn check(&self, h: &Handle) -> Result<(), RmCallError> {
        match self.regions.get(&h.region_id) {
            Some((r, RegionState::Allocated)) if r == h => Ok(()),
            Some((_, RegionState::Draining)) => Err(RmCallError::Refused(format!(
                "region {} is draining",
                h.region_id
            ))),
            _ => Err(RmCallError::Refused("bad handle".into())),
        }
    }

    fn away(&self) -> Result<(), RmCallError> {
        if self.down {
            Err(RmCallError::Failed("connection refused".into()))
        } else {
            Ok(())
        }
    }

    pub fn count(&self, prefix: &str) -> usize {
        self.calls.iter().filter(|c| c.starts_with(prefix)).count()
    }
}

impl RmPort for FakeRm {
    fn hold(&mut self, h: &Handle, node: &str, epoch: u64) -> Result<(), RmCallError> {
        assert_eq!((node, epoch), (NODE, EPOCH));
        self.calls.push(format!("hold {}", h.region_id));
        self.away()?;
        self.check(h)?;
        self.held.insert(h.region_id);
        if self.lose_hold_reply {
            return Err(RmCallError::Failed("reply lost".into()));
        }
        Ok(())
    }

    fn unhold(&mut self, region_id: u64, node: &str, epoch: u64) -> Result<(), RmCallError> {
        assert_eq!((node, epoch), (NODE, EPOCH));
        self.calls.push(format!("unhold {region_id}"));
        self.away()?;
        if self.fail_unhold {
            return Err(RmCallError::Failed("storage: cannot save the holds".into()));
        }
        if self.refuse_unhold {
            return Err(RmCallError::Refused("no such hold".into()));
        }
        self.held.remove(&region_id);
        Ok(())
    }

    fn get_access(&mut self, h: &Handle) -> Result<AccessReply, RmCallError> {
        self.calls.push(format!("access {}", h.region_id));
        self.away()?;
        self.check(h)?;
        Ok(AccessReply {
            region_id: h.region_id,
            path: "/dev/dax0.0".into(),
            uuid: "u".into(),
            offset: h.offset,
            length: h.length,
            align: LEN,
        })
    }

    fn reset_holds(&mut self, node: &str, epoch: u64) -> Result<(), RmCallError> {
        assert_eq!((node, epoch), (NODE, EPOCH));
        self.calls.push("reset".into());
        self.away()?;
        self.resets += 1;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeRange {
    pub ptr: u64,
    pub len: u64,
    pub protected: bool,
}

/// Memory that, like mmap, puts a new mapping at the lowest free addresses.
#[derive(Debug, Default)]
pub struct FakeMem {
    pub ranges: BTreeMap<u64, FakeRange>,
    pub fail_map: bool,
    pub maps: usize,
    pub unmaps: Vec<u64>,
    next_id: u64,
}

const SLOT: u64 = 1 << 32;

impl FakeMem {
    pub fn range_at(&self, ptr: u64) -> Option<&FakeRange> {
        self.ranges.values().find(|r| r.ptr == ptr)
    }
}

impl MemPort for FakeMem {
    fn map(&mut self, access: &AccessReply) -> Result<MappedRange, String> {
        if self.fail_map {
            return Err("mmap: no such device".into());
        }
        let taken: BTreeSet<u64> = self.ranges.values().map(|r| r.ptr).collect();
        let ptr = (1..)
            .map(|k| k * SLOT)
            .find(|p| !taken.contains(p))
            .unwrap_or(0);
        self.next_id += 1;
        self.maps += 1;
        let r = FakeRange {
            ptr,
            len: access.length,
            protected: false,
        };
        self.ranges.insert(self.next_id, r);
        Ok(MappedRange {
            id: self.next_id,
            ptr,
            len: access.length,
        })
    }

    fn protect_none(&mut self, id: u64) -> Result<(), String> {
        match self.ranges.get_mut(&id) {
            Some(r) => {
                r.protected = true;
                Ok(())
            }
            None => Err(format!("no mapping {id}")),
        }
    }

    fn unmap(&mut self, id: u64) {
        self.unmaps.push(id);
        assert!(
            self.ranges.remove(&id).is_some(),
            "unmap of unknown mapping {id}"
        );
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeReg {
    /// The holder (agent connection) it was registered for: the only one whose data
    /// path the NIC accepts it on.
    pub holder: String,
    pub ptr: u64,
    pub len: u64,
    pub writable: bool,
}

/// A NIC whose key is a function of the registered range, as a NIC that reuses
/// keys for the same range behaves.
#[derive(Debug, Default)]
pub struct FakeNic {
    pub live: BTreeMap<u64, FakeReg>,
    pub fail_register: bool,
    pub fail_deregister: bool,
    pub registers: usize,
    pub deregisters: Vec<u64>,
    pub deregister_attempts: usize,
}

impl FakeNic {
    pub fn accepts(&self, rkey: u64) -> bool {
        self.live.contains_key(&rkey)
    }

    /// Whether the NIC accepts `rkey` on the data path of `holder`'s connection.
    pub fn accepts_from(&self, holder: &str, rkey: u64) -> bool {
        self.live.get(&rkey).is_some_and(|r| r.holder == holder)
    }
}

impl NicPort for FakeNic {
    fn register(
        &mut self,
        holder: &str,
        ptr: u64,
        len: u64,
        writable: bool,
    ) -> Result<Registration, String> {
        if self.fail_register {
            return Err("ibv_reg_mr: cannot allocate memory".into());
        }
        let mut rkey = (ptr >> 12) ^ (len << 1) ^ u64::from(writable);
        while self.live.contains_key(&rkey) {
            rkey += 1 << 40;
        }
        self.registers += 1;
        let holder = holder.to_string();
        self.live.insert(
            rkey,
            FakeReg {
                holder,
                ptr,
                len,
                writable,
            },
        );
        Ok(Registration {
            rkey,
            addr: ptr,
            transport: serde_json::json!({ "fake": rkey }),
        })
    }

    fn deregister(&mut self, rkey: u64) -> Result<(), String> {
        self.deregister_attempts += 1;
        if self.fail_deregister {
            return Err("ibv_dereg_mr: device busy".into());
        }
        if self.live.remove(&rkey).is_none() {
            return Err(format!("unknown key {rkey}"));
        }
        self.deregisters.push(rkey);
        Ok(())
    }
}

/// An agent with its fakes and a clock.
pub struct World {
    pub core: AgentCore,
    pub rm: FakeRm,
    pub mem: FakeMem,
    pub nic: FakeNic,
    pub now: u64,
}

impl World {
    pub fn new() -> World {
        let mut w = World {
            core: AgentCore::new(NODE.into(), EPOCH, BOOT.into(), Q_MS).unwrap(),
            rm: FakeRm::default(),
            mem: FakeMem::default(),
            nic: FakeNic::default(),
            now: 1_000,
        };
        w.core.start(&mut w.rm);
        w
    }

    pub fn req(&mut self, client: &str, req: AgentRequest) -> Result<AgentReply, WireError> {
        self.core.handle(
            client,
            req,
            self.now,
            &mut self.rm,
            &mut self.mem,
            &mut self.nic,
        )
    }

    /// A new region of the RM, mapped writable for `client`.
    /// A new world with a region mapped writable by `client`.
    pub fn with_mapped(client: &str) -> (World, Handle, MapReply) {
        let mut w = World::new();
        let (h, m) = w.mapped(client);
        (w, h, m)
    }

    pub fn mapped(&mut self, client: &str) -> (Handle, MapReply) {
        let h = self.rm.region();
        let m = self.map(client, &h, true).unwrap();
        (h, m)
    }

    pub fn map(&mut self, client: &str, h: &Handle, writable: bool) -> Result<MapReply, WireError> {
        let handle = h.clone();
        match self.req(client, AgentRequest::Map { handle, writable })? {
            AgentReply::Mapped(m) => Ok(m),
            other => panic!("map: {other:?}"),
        }
    }

    /// A read map with the right token for the range.
    pub fn map_read(
        &mut self,
        client: &str,
        h: &Handle,
        offset: u64,
        length: u64,
    ) -> Result<MapReply, WireError> {
        let token = read_token(&h.token, h.region_id, offset, length);
        self.map_read_with(client, h.region_id, offset, length, token)
    }

    pub fn map_read_with(
        &mut self,
        client: &str,
        region_id: u64,
        offset: u64,
        length: u64,
        read_token: String,
    ) -> Result<MapReply, WireError> {
        let range = ReadRange {
            region_id,
            offset,
            length,
            read_token,
        };
        let req = AgentRequest::MapReads {
            ranges: vec![range],
        };
        self.req(client, req)?.single_read()
    }

    /// A `map_reads` of `ranges`: its per-range results.
    pub fn map_reads(
        &mut self,
        client: &str,
        ranges: Vec<ReadRange>,
    ) -> Result<Vec<RangeMapped>, WireError> {
        let n = ranges.len();
        match self.req(client, AgentRequest::MapReads { ranges })? {
            AgentReply::MappedReads { ranges } => {
                assert_eq!(ranges.len(), n, "one result per range asked");
                Ok(ranges)
            }
            other => panic!("map_reads: {other:?}"),
        }
    }

    pub fn unmap(&mut self, client: &str, region_id: u64) -> bool {
        match self.req(client, AgentRequest::Unmap { region_id }) {
            Ok(AgentReply::Unmapped { removed }) => removed,
            other => panic!("unmap: {other:?}"),
        }
    }

    pub fn release(&mut self, client: &str, h: &Handle) -> Result<bool, WireError> {
        let handle = h.clone();
        match self.req(client, AgentRequest::Release { handle })? {
            AgentReply::Released { deregistered } => Ok(deregistered),
            other => panic!("release: {other:?}"),
        }
    }

    pub fn close(&mut self, client: &str) {
        self.core
            .client_closed(client, self.now, &mut self.rm, &mut self.mem, &mut self.nic);
    }

    pub fn sweep(&mut self) {
        self.core
            .sweep(self.now, &mut self.rm, &mut self.mem, &mut self.nic);
    }

    /// Unholds the sweep still owes the RM.
    pub fn queued(&self) -> usize {
        self.core.status().queued_unholds
    }

    /// Maps `h` for `client` (writable), which must fail with `code` and a message that
    /// says `says`.
    #[track_caller]
    pub fn map_fails(&mut self, client: &str, h: &Handle, code: ErrorCode, says: &str) {
        let e = self.map(client, h, true).unwrap_err();
        assert_eq!(e.code, code, "{e}");
        assert!(e.message.contains(says), "{e}");
    }

    /// Checks that the RM still holds region `id` and that its unhold (the only one)
    /// waits for the sweep.
    #[track_caller]
    pub fn unhold_queued(&self, id: u64) {
        assert!(self.rm.held.contains(&id), "held: {:?}", self.rm.held);
        assert_eq!(self.queued(), 1);
    }

    /// Sweeps, and checks that the RM was given every hold back and none is queued.
    #[track_caller]
    pub fn sweep_clears_every_hold(&mut self) {
        self.sweep();
        assert!(self.rm.held.is_empty(), "held: {:?}", self.rm.held);
        assert_eq!(self.queued(), 0);
    }

    pub fn advance(&mut self, ms: u64) {
        self.now += ms;
    }
}
