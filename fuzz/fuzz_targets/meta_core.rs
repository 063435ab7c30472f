//! maru-server's core under hostile requests: request lines (as the daemon decodes
//! them) from two clients of two tenants, run by a real `MetaCore` over an RM and
//! agents that answer (and sometimes refuse or fail; allocations answered at once, late
//! or never), with time moving on and the keeper ticking. Bad counts, offsets, lengths,
//! ids of other sessions or tenants: errors, never a panic, and the core never holds
//! more regions than the RM handed out.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::meta::ports::{AgentPort, PoolSizes, PortError, RmPort};
use maru::meta::{Action, Caller, MetaConfig, MetaCore, TenantSpec, Tenants, DEFAULT_TENANT};
use maru::wire::meta::MetaRequest;
use maru::wire::rm::{AllocReply, Handle, PoolInfo};
use maru::wire::{decode_json, Envelope};

const REGION: u64 = 256 << 10;

struct Rm {
    next: u64,
    live: u64,
    fail_every: u64,
    /// Regions allocated and not freed: the RM's answer to a check of its list.
    ids: std::collections::BTreeSet<u64>,
}

impl Rm {
    fn alloc(&mut self, size: u64) -> Result<AllocReply, PortError> {
        self.next += 1;
        if self.fail_every > 0 && self.next.is_multiple_of(self.fail_every) {
            return Err(PortError::Refused("no space".into()));
        }
        self.live += 1;
        self.ids.insert(self.next);
        Ok(AllocReply {
            handle: Handle {
                region_id: self.next,
                offset: self.next * REGION,
                length: size,
                token: format!("{:032x}", self.next),
            },
            requested: size,
            pool: PoolInfo {
                pool_id: 0,
                path: "/dev/shm/fuzz".into(),
                uuid: "00000000-0000-4000-8000-000000000001".into(),
                kind: "file".into(),
                total: 1 << 30,
                free: 1 << 29,
                align: REGION,
                draining: 0,
            },
        })
    }
}

impl RmPort for Rm {
    fn free(&mut self, h: &Handle) -> Result<(), PortError> {
        self.live = self.live.saturating_sub(1);
        self.ids.remove(&h.region_id);
        Ok(())
    }

    fn pool_sizes(&mut self) -> Result<PoolSizes, PortError> {
        Ok(PoolSizes {
            largest: 1 << 30,
            total: 1 << 30,
        })
    }
}

struct Agents(u64);

impl AgentPort for Agents {
    fn map(&mut self, _agent: &str, _h: &Handle) -> Result<String, PortError> {
        self.0 += 1;
        match self.0 % 5 {
            0 => Err(PortError::Unreachable("down".into())),
            _ => Ok("boot-1".into()),
        }
    }

    fn release(&mut self, _agent: &str, _h: &Handle) -> Result<(), PortError> {
        self.0 += 1;
        match self.0 % 7 {
            0 => Err(PortError::Failed("busy".into())),
            _ => Ok(()),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, rest)) = data.split_first() else {
        return;
    };
    let cfg = MetaConfig {
        region_size: REGION,
        chunk_size: 64 << 10,
        agents: vec!["127.0.0.1:9860".into()],
        session_timeout_ms: 5_000,
        lease_timeout_ms: 3_000,
        max_sessions: 4,
        ..MetaConfig::default()
    };
    let Ok(core) = MetaCore::new(cfg) else {
        return;
    };
    let tenants = Tenants::new(vec![
        TenantSpec::unclaimed(Default::default()),
        TenantSpec::writer("t2", &["ns2", "b*"]).expect("a tenant"),
    ])
    .expect("tenants");
    let mut core = core.with_tenants(tenants);
    let mut rm = Rm {
        next: 0,
        live: 0,
        fail_every: (ctl % 4) as u64,
        ids: Default::default(),
    };
    let mut agents = Agents(0);
    let mut now = 1u64;
    let mut pending: Vec<(u64, u64)> = Vec::new();
    for (i, line) in rest.split(|&b| b == b'\n').take(48).enumerate() {
        let caller = if i % 3 == 2 {
            Caller {
                owner: "w2",
                tenant: "t2",
            }
        } else {
            Caller {
                owner: "w1",
                tenant: DEFAULT_TENANT,
            }
        };
        if let Ok(env) = decode_json::<Envelope<MetaRequest>>(line) {
            let _ = core.handle(&caller, i as u64, env.body, now, &mut rm);
        } else if line.first() == Some(&b'x') {
            core.client_closed(caller.owner, now);
        } else if line.first() == Some(&b'c') {
            core.cancel(i.saturating_sub(1) as u64);
        }
        // The RM answers allocations at once, one line later, or never (by the line);
        // a check of its list at once, with its list or (by the line) unreachable.
        while let Some(action) = core.next_action() {
            match action {
                Action::Alloc { alloc, size } => pending.push((alloc, size)),
                Action::CheckRm { check } => {
                    let held = if line.len() % 5 == 4 {
                        Err(PortError::Unreachable("down".into()))
                    } else {
                        Ok(rm.ids.iter().copied().collect())
                    };
                    core.rm_regions(check, held, now);
                }
            }
        }
        if line.len() % 3 != 1 {
            for (alloc, size) in pending.drain(..) {
                let r = rm.alloc(size);
                core.alloc_done(alloc, r, now, &mut rm);
            }
        }
        let _ = core.take_answers();
        now += 1 + (line.len() as u64 % 4) * 1_000;
        core.tick(now, &mut rm, &mut agents);
        assert!(
            core.region_count() as u64 <= rm.live,
            "more regions than the RM gave"
        );
    }
    core.give_back_kept(now);
    for _ in 0..4 {
        now += 40_000;
        core.tick(now, &mut rm, &mut agents);
    }
});
