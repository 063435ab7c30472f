//! A trace replayed through maru-server's core ([`MetaCore`], driven directly:
//! sans-I/O, no daemon, no bytes moved): a session per engine sharing one pool by
//! fair share, each request routed to its engine, which looks its prompt up
//! (`exists`), reads the leading hits (`acquire`, which marks them read), and stores
//! the chunks after the first miss that are not stored (`alloc`, else `expand`,
//! else `victims` and `remove`; then `publish`, each chunk naming the one before it).
//! Regions asked back for another engine's fair share are returned with their keys.

use maru::meta::{
    AgentPort, Caller, MetaConfig, MetaCore, PoolSizes, PortError, RmPort, VictimOrder,
};
use maru::wire::meta::{Backend, MetaReply, MetaRequest, PublishEntry};
use maru::wire::rm::{AllocReply, Handle, PoolInfo};
use std::collections::BTreeSet;

use super::trace::Trace;

/// Pages (chunks) per region.
pub const REGION_PAGES: u64 = 16;
const PAGE: u64 = 1 << 20;

/// The RM of the replay: regions of `REGION_PAGES` pages until `capacity` regions
/// are out.
struct Rm {
    capacity: u64,
    out: BTreeSet<u64>,
    next: u64,
}

impl Rm {
    fn alloc(&mut self, size: u64) -> Result<AllocReply, PortError> {
        if self.out.len() as u64 >= self.capacity {
            return Err(PortError::Refused("no space".into()));
        }
        self.next += 1;
        self.out.insert(self.next);
        Ok(AllocReply {
            handle: Handle {
                region_id: self.next,
                offset: self.next * size,
                length: size,
                token: format!("{:032x}", self.next),
            },
            requested: size,
            pool: PoolInfo {
                pool_id: 0,
                path: "/dev/dax0.0".into(),
                uuid: "00000000-0000-4000-8000-000000000000".into(),
                kind: "devdax".into(),
                total: self.capacity * size,
                free: (self.capacity - self.out.len() as u64) * size,
                align: PAGE,
                draining: 0,
            },
        })
    }
}

impl RmPort for Rm {
    fn free(&mut self, h: &Handle) -> Result<(), PortError> {
        self.out.remove(&h.region_id);
        Ok(())
    }
    fn pool_sizes(&mut self) -> Result<PoolSizes, PortError> {
        let total = self.capacity * REGION_PAGES * PAGE;
        Ok(PoolSizes {
            largest: total,
            total,
        })
    }
}

struct NoAgents;

impl AgentPort for NoAgents {
    fn map(&mut self, _: &str, _: &Handle) -> Result<String, PortError> {
        Err(PortError::Refused("no agents".into()))
    }
    fn release(&mut self, _: &str, _: &Handle) -> Result<(), PortError> {
        Ok(())
    }
}

/// maru-server's core with a session per engine, and the clock.
struct Server {
    core: MetaCore,
    rm: Rm,
    now: u64,
    ticket: u64,
    sessions: Vec<u64>,
}

impl Server {
    fn new(order: VictimOrder, regions: u64, engines: usize) -> Result<Server, String> {
        let cfg = MetaConfig {
            region_size: REGION_PAGES * PAGE,
            chunk_size: PAGE,
            victim_order: order,
            ..MetaConfig::default()
        };
        let core = MetaCore::new(cfg).map_err(|e| e.to_string())?;
        let mut s = Server {
            core,
            rm: Rm {
                capacity: regions,
                out: BTreeSet::new(),
                next: 0,
            },
            now: 1,
            ticket: 0,
            sessions: Vec::new(),
        };
        for e in 0..engines {
            let r = s.call(
                e,
                MetaRequest::OpenSession {
                    engine_id: format!("engine-{e}"),
                    namespace: "chat".into(),
                    layout: "l".into(),
                    backend: Backend::Cxl,
                    first_region: false,
                },
            )?;
            match r {
                MetaReply::Session(s2) => s.sessions.push(s2.session),
                other => return Err(format!("open: {other:?}")),
            }
        }
        Ok(s)
    }

    /// One request of engine `e`, waited for (a region request may wait for the RM
    /// or for room: the clock moves in 10 ms steps, ticking, up to 2 s).
    fn call(&mut self, e: usize, req: MetaRequest) -> Result<MetaReply, String> {
        self.ticket += 1;
        let t = self.ticket;
        let owner = format!("engine-{e}");
        let caller = Caller {
            owner: &owner,
            tenant: maru::meta::DEFAULT_TENANT,
        };
        let r = self.core.handle(&caller, t, req, self.now, &mut self.rm);
        if let Some(r) = r {
            return r.map_err(|e| e.message);
        }
        for _ in 0..200 {
            while let Some(action) = self.core.next_action() {
                match action {
                    maru::meta::Action::Alloc { alloc, size } => {
                        let a = self.rm.alloc(size);
                        self.core.alloc_done(alloc, a, self.now, &mut self.rm);
                    }
                    maru::meta::Action::CheckRm { check } => {
                        let held = self.rm.out.iter().copied().collect();
                        self.core.rm_regions(check, Ok(held), self.now);
                    }
                }
            }
            if let Some((_, r)) = self.core.take_answers().into_iter().find(|(x, _)| *x == t) {
                return r.map_err(|e| e.message);
            }
            self.now += 10;
            self.core.tick(self.now, &mut self.rm, &mut NoAgents);
        }
        Err("a region request was never answered".into())
    }

    /// Returns the regions maru-server asked engine `e` for.
    fn give_back(&mut self, e: usize, regions: &[u64]) -> Result<(), String> {
        for &region_id in regions {
            let session = self.sessions[e];
            let _ = self.call(
                e,
                MetaRequest::ReturnRegion {
                    session,
                    region_id,
                    released: true,
                },
            )?;
        }
        Ok(())
    }

    /// Pages for `n` chunks of engine `e`: alloc, else a region, else evictions.
    fn pages(&mut self, e: usize, n: u32) -> Result<Vec<(u64, u64)>, String> {
        let session = self.sessions[e];
        let mut got = Vec::new();
        for _ in 0..8 {
            let want = n - got.len() as u32;
            if want == 0 {
                break;
            }
            let (pages, missing, back) = match self.call(
                e,
                MetaRequest::Alloc {
                    session,
                    count: want,
                    route_key: None,
                },
            )? {
                MetaReply::Pages(p) => (p.pages, p.missing, p.give_back),
                other => return Err(format!("alloc: {other:?}")),
            };
            got.extend(pages.iter().map(|p| (p.region_id, p.offset)));
            self.give_back(e, &back)?;
            if missing == 0 {
                break;
            }
            if self.call(e, MetaRequest::Expand { session }).is_ok() {
                continue;
            }
            let victims = match self.call(
                e,
                MetaRequest::Victims {
                    session,
                    max: missing,
                },
            )? {
                MetaReply::Victims { victims } => victims,
                other => return Err(format!("victims: {other:?}")),
            };
            if victims.is_empty() {
                break;
            }
            let keys = victims.into_iter().map(|v| v.key).collect();
            self.call(e, MetaRequest::Remove { session, keys })?;
        }
        Ok(got)
    }

    /// One request of engine `e`: the leading hits.
    fn request(&mut self, e: usize, chunks: &[u32], names: &[String]) -> Result<usize, String> {
        let session = self.sessions[e];
        self.now += 1;
        let keys: Vec<String> = chunks.iter().map(|&c| names[c as usize].clone()).collect();
        let found = match self.call(
            e,
            MetaRequest::Exists {
                session,
                keys: keys.clone(),
            },
        )? {
            MetaReply::Exists { found } => found,
            other => return Err(format!("exists: {other:?}")),
        };
        let lead = found.iter().take_while(|f| **f).count();
        if lead > 0 {
            let leases = match self.call(
                e,
                MetaRequest::Acquire {
                    session,
                    keys: keys[..lead].to_vec(),
                },
            )? {
                MetaReply::Leases { leases } => leases,
                other => return Err(format!("acquire: {other:?}")),
            };
            let lease_ids = leases.into_iter().flatten().map(|l| l.lease_id).collect();
            self.call(e, MetaRequest::ReleaseLeases { session, lease_ids })?;
        }
        let todo: Vec<usize> = (lead..keys.len()).filter(|&i| !found[i]).collect();
        if todo.is_empty() {
            return Ok(lead);
        }
        let pages = self.pages(e, todo.len() as u32)?;
        let entries: Vec<PublishEntry> = todo
            .iter()
            .zip(&pages)
            .map(|(&i, &(region_id, offset))| PublishEntry {
                key: keys[i].clone(),
                region_id,
                offset,
                length: PAGE,
                prev: i.checked_sub(1).map(|j| keys[j].clone()),
            })
            .collect();
        if !entries.is_empty() {
            if let MetaReply::Published { give_back, .. } =
                self.call(e, MetaRequest::Publish { session, entries })?
            {
                self.give_back(e, &give_back)?;
            }
        }
        Ok(lead)
    }
}

/// Replays `t` through maru-server's core with `order`, `regions` regions of
/// `REGION_PAGES` pages and `route`'s engines; hits over chunk accesses.
pub fn replay(t: &Trace, route: &[usize], order: VictimOrder, regions: u64) -> Result<f64, String> {
    let engines = route.iter().max().map_or(1, |m| m + 1);
    let names: Vec<String> = (0..t.distinct).map(|c| format!("c{c}")).collect();
    let mut s = Server::new(order, regions, engines)?;
    let mut hits = 0usize;
    for (r, &e) in t.requests.iter().zip(route) {
        hits += s.request(e, r, &names)?;
    }
    Ok(hits as f64 / t.accesses().max(1) as f64)
}
