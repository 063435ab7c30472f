//! Hit rate of a full cache on a synthesized multi-turn chat trace, replayed through
//! maru-server's eviction (its core, [`MetaCore`], driven directly: sans-I/O, no
//! daemon, no bytes moved), beside plain LRU and Belady's offline optimum for the
//! same capacity.
//!
//! The trace: `SYSTEMS` system prompts shared by many conversations; conversations
//! whose popularity follows a Zipf law; each request is a conversation's next turn, its
//! prompt the system prompt's chunks then the whole history so far (two chunks more
//! per turn), routed to one of `ENGINES` engines by conversation (as a prefix-aware
//! load balancer does). A conversation that reached `MAX_TURNS` starts over (new
//! keys). Every engine looks its prompt up (`exists`), reads the leading hits
//! (`acquire`, which marks them read), and stores the chunks after the first miss
//! that are not stored; a hit is a chunk of the leading run found. The cache holds a
//! fixed number of chunks (pages), an eighth of the distinct chunks of the trace.
//!
//! - **Maru**: maru-server's core, `--victim-order prefix-aware` (the default: tails of
//!   prefix chains first), four sessions sharing the pool by fair share.
//! - **LRU (maru-server)**: the same core with `--victim-order lru`.
//! - **LRU (global)**, **Belady**: one cache of the same number of chunks, no
//!   per-engine split; Belady evicts the chunk whose next use is furthest away (the
//!   offline optimum for chunk hits, an upper bound here: a hit counts only in the
//!   leading run).
//! - **SLRU**, **LRU + reads** (one global cache each): frequency-aware orders that
//!   know only what maru-server knows, measured to see whether counting reads beats
//!   recency on this trace (it does not: docs/benchmarks.md).

use maru::meta::{
    AgentPort, Caller, MetaConfig, MetaCore, PoolSizes, PortError, RmPort, VictimOrder,
};
use maru::wire::meta::{Backend, MetaReply, MetaRequest, PublishEntry};
use maru::wire::rm::{AllocReply, Handle, PoolInfo};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};

use crate::report::Table;

const ENGINES: usize = 4;
const SYSTEMS: usize = 8;
const SYSTEM_CHUNKS: usize = 4;
const MAX_TURNS: usize = 12;
const ZIPF: f64 = 0.9;
/// Pages (chunks) per region.
const REGION_PAGES: u64 = 16;
const PAGE: u64 = 1 << 20;

/// One request: the engine it goes to and its prompt's chunk keys (ids), in order.
struct Request {
    engine: usize,
    chunks: Vec<u32>,
}

struct Trace {
    requests: Vec<Request>,
    names: Vec<String>,
}

/// xorshift64*: a fixed, seeded stream (the trace is the same at every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn synthesize(conversations: usize, requests: usize) -> Trace {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let weights: Vec<f64> = (1..=conversations)
        .map(|r| 1.0 / (r as f64).powf(ZIPF))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(conversations);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut names = Vec::new();
    let mut id = |name: String| -> u32 {
        *ids.entry(name.clone()).or_insert_with(|| {
            names.push(name);
            (names.len() - 1) as u32
        })
    };
    let mut turn = vec![0usize; conversations];
    let mut epoch = vec![0usize; conversations];
    let mut out = Vec::with_capacity(requests);
    for _ in 0..requests {
        let u = rng.unit();
        let c = cdf.partition_point(|&x| x < u).min(conversations - 1);
        turn[c] += 1;
        if turn[c] > MAX_TURNS {
            turn[c] = 1;
            epoch[c] += 1;
        }
        let s = c % SYSTEMS;
        let mut chunks: Vec<u32> = (0..SYSTEM_CHUNKS)
            .map(|i| id(format!("s{s}/{i}")))
            .collect();
        chunks.extend((0..2 * turn[c]).map(|j| id(format!("s{s}/c{c}e{}/{j}", epoch[c]))));
        out.push(Request {
            engine: c % ENGINES,
            chunks,
        });
    }
    Trace {
        requests: out,
        names,
    }
}

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
    fn owned_regions(&mut self) -> Result<Vec<u64>, PortError> {
        Ok(self.out.iter().copied().collect())
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

/// maru-server's core with `ENGINES` sessions, and the clock.
struct Server {
    core: MetaCore,
    rm: Rm,
    now: u64,
    ticket: u64,
    sessions: Vec<u64>,
}

impl Server {
    fn new(order: VictimOrder, regions: u64) -> Result<Server, String> {
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
        for e in 0..ENGINES {
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
            while let Some(maru::meta::Action::Alloc { alloc, size }) = self.core.next_action() {
                let a = self.rm.alloc(size);
                self.core.alloc_done(alloc, a, self.now, &mut self.rm);
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

    /// One request: the leading hits.
    fn request(&mut self, r: &Request, names: &[String]) -> Result<usize, String> {
        let e = r.engine;
        let session = self.sessions[e];
        self.now += 1;
        let keys: Vec<String> = r
            .chunks
            .iter()
            .map(|&c| names[c as usize].clone())
            .collect();
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

/// Replays `t` through maru-server's core with `order`; the hit rate.
fn replay_core(t: &Trace, order: VictimOrder, regions: u64) -> Result<f64, String> {
    let mut s = Server::new(order, regions)?;
    let (mut hits, mut asked) = (0usize, 0usize);
    for r in &t.requests {
        hits += s.request(r, &t.names)?;
        asked += r.chunks.len();
    }
    Ok(hits as f64 / asked.max(1) as f64)
}

/// The hit rate of a replay: `serve` takes each request's chunks in turn, returns the
/// length of its leading run that was cached (a prefix cache loads only that) and
/// records the request in its cache.
fn hit_rate(t: &Trace, mut serve: impl FnMut(&[u32]) -> usize) -> f64 {
    let (mut hits, mut asked) = (0usize, 0usize);
    for r in &t.requests {
        hits += serve(&r.chunks);
        asked += r.chunks.len();
    }
    hits as f64 / asked.max(1) as f64
}

/// How many of `chunks`, from the first, are in `cache`.
fn leading_run<V>(chunks: &[u32], cache: &HashMap<u32, V>) -> usize {
    chunks.iter().take_while(|c| cache.contains_key(c)).count()
}

/// Drops the lowest entries of `order` (and their chunks from `cache`) until at most
/// `capacity` are left.
fn evict_lowest<V>(order: &mut BTreeSet<(u64, u32)>, cache: &mut HashMap<u32, V>, capacity: usize) {
    while order.len() > capacity {
        if let Some((_, v)) = order.pop_first() {
            cache.remove(&v);
        }
    }
}

/// Global LRU of `capacity` chunks.
fn replay_lru(t: &Trace, capacity: usize) -> f64 {
    let mut stamp: HashMap<u32, u64> = HashMap::new();
    let mut order: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut clock = 0u64;
    hit_rate(t, |chunks| {
        let lead = leading_run(chunks, &stamp);
        for &c in chunks {
            clock += 1;
            if let Some(old) = stamp.insert(c, clock) {
                order.remove(&(old, c));
            }
            order.insert((clock, c));
            evict_lowest(&mut order, &mut stamp, capacity);
        }
        lead
    })
}

/// Belady's MIN over the same accesses: the chunk used again furthest ahead goes.
fn replay_belady(t: &Trace, capacity: usize) -> f64 {
    // Next use of each access, by position in the flattened stream.
    let stream: Vec<u32> = t
        .requests
        .iter()
        .flat_map(|r| r.chunks.iter().copied())
        .collect();
    let mut next = vec![u64::MAX; stream.len()];
    let mut seen: HashMap<u32, u64> = HashMap::new();
    for (i, &c) in stream.iter().enumerate().rev() {
        if let Some(&n) = seen.get(&c) {
            next[i] = n;
        }
        seen.insert(c, i as u64);
    }
    let mut when: HashMap<u32, u64> = HashMap::new();
    let mut order: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut pos = 0usize;
    hit_rate(t, |chunks| {
        let lead = leading_run(chunks, &when);
        for &c in chunks {
            let n = next[pos];
            pos += 1;
            if let Some(old) = when.remove(&c) {
                order.remove(&(old, c));
            }
            if n == u64::MAX {
                continue; // never used again: not worth a page
            }
            when.insert(c, n);
            order.insert((n, c));
            while order.len() > capacity {
                if let Some((_, v)) = order.pop_last() {
                    when.remove(&v);
                }
            }
        }
        lead
    })
}

/// Segmented LRU over one global cache of `capacity` chunks: a chunk read again
/// (in a leading run) since it was stored moves to the protected segment (at most
/// `protected` of the capacity, its oldest demoted back); chunks never read again go
/// first, least recently used first. A frequency-aware order that knows only what
/// maru-server knows (stores and reads).
fn replay_slru(t: &Trace, capacity: usize, protected: f64) -> f64 {
    // Per chunk: its stamp and whether it is protected.
    let mut state: HashMap<u32, (u64, bool)> = HashMap::new();
    let mut probation: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut kept: BTreeSet<(u64, u32)> = BTreeSet::new();
    let max_kept = (capacity as f64 * protected) as usize;
    let mut clock = 0u64;
    hit_rate(t, |chunks| {
        let lead = leading_run(chunks, &state);
        for (i, &c) in chunks.iter().enumerate() {
            clock += 1;
            let was = state.get(&c).copied();
            if let Some((old, prot)) = was {
                if prot {
                    kept.remove(&(old, c));
                } else {
                    probation.remove(&(old, c));
                }
            }
            let prot = was.is_some_and(|(_, p)| p) || (was.is_some() && i < lead);
            state.insert(c, (clock, prot));
            if prot {
                kept.insert((clock, c));
            } else {
                probation.insert((clock, c));
            }
            while kept.len() > max_kept {
                if let Some((st, v)) = kept.pop_first() {
                    state.insert(v, (st, false));
                    probation.insert((st, v));
                }
            }
            while probation.len() + kept.len() > capacity {
                let v = match probation.pop_first() {
                    Some((_, v)) => v,
                    None => match kept.pop_first() {
                        Some((_, v)) => v,
                        None => break,
                    },
                };
                state.remove(&v);
            }
        }
        lead
    })
}

/// One global cache of `capacity` chunks ordered by last use plus `bonus` per read
/// (in a leading run) since the chunk was stored: recency with a frequency credit
/// that ages as the clock moves on (the lowest goes).
fn replay_lru_freq(t: &Trace, capacity: usize, bonus: u64) -> f64 {
    let mut state: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut order: BTreeSet<(u64, u32)> = BTreeSet::new();
    let mut clock = 0u64;
    hit_rate(t, |chunks| {
        let lead = leading_run(chunks, &state);
        for (i, &c) in chunks.iter().enumerate() {
            clock += 1;
            let reads = match state.get(&c).copied() {
                Some((prio, n)) => {
                    order.remove(&(prio, c));
                    n + u64::from(i < lead)
                }
                None => 0,
            };
            let prio = clock + bonus * reads;
            state.insert(c, (prio, reads));
            order.insert((prio, c));
            evict_lowest(&mut order, &mut state, capacity);
        }
        lead
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct HitRateResult {
    pub requests: usize,
    pub conversations: usize,
    pub distinct_chunks: usize,
    pub capacity_chunks: u64,
    pub maru: f64,
    pub lru_core: f64,
    pub lru_global: f64,
    /// Segmented LRU (80 % protected), one global cache.
    pub slru_global: f64,
    /// Last use plus a quarter of the capacity per read, one global cache.
    pub lru_freq_global: f64,
    pub belady: f64,
}

pub fn run(quick: bool) -> Result<HitRateResult, String> {
    let (conversations, requests) = if quick { (400, 6_000) } else { (1_000, 30_000) };
    let t = synthesize(conversations, requests);
    let distinct = t.names.len();
    let regions = (distinct as u64 / 8 / REGION_PAGES).max(ENGINES as u64);
    let capacity = regions * REGION_PAGES;
    Ok(HitRateResult {
        requests,
        conversations,
        distinct_chunks: distinct,
        capacity_chunks: capacity,
        maru: replay_core(&t, VictimOrder::PrefixAware, regions)?,
        lru_core: replay_core(&t, VictimOrder::Lru, regions)?,
        lru_global: replay_lru(&t, capacity as usize),
        slru_global: replay_slru(&t, capacity as usize, 0.8),
        lru_freq_global: replay_lru_freq(&t, capacity as usize, capacity / 4),
        belady: replay_belady(&t, capacity as usize),
    })
}

pub fn table(r: &HitRateResult) -> Table {
    let mut t = Table::new(
        &format!(
            "Hit rate on a multi-turn chat trace ({} requests, {} conversations Zipf {ZIPF}, {SYSTEMS} system prompts, {ENGINES} engines; cache {} of {} distinct chunks)",
            r.requests, r.conversations, r.capacity_chunks, r.distinct_chunks
        ),
        &["policy", "hit rate", "of Belady"],
    );
    for (name, v) in [
        ("Maru (maru-server, prefix-aware)", r.maru),
        ("LRU (maru-server, --victim-order lru)", r.lru_core),
        ("LRU (one global cache)", r.lru_global),
        ("SLRU, 80 % protected (one global cache)", r.slru_global),
        (
            "LRU + a quarter cache per read (one global cache)",
            r.lru_freq_global,
        ),
        ("Belady (offline optimum)", r.belady),
    ] {
        t.row(vec![
            name.into(),
            format!("{v:.3}"),
            format!("{:.3}", v / r.belady.max(1e-9)),
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_optimum_bounds_every_policy_and_the_replay_hits() {
        let t = synthesize(60, 600);
        let regions = (t.names.len() as u64 / 8 / REGION_PAGES).max(ENGINES as u64);
        let cap = (regions * REGION_PAGES) as usize;
        let belady = replay_belady(&t, cap);
        let lru = replay_lru(&t, cap);
        let maru = replay_core(&t, VictimOrder::PrefixAware, regions).unwrap();
        let slru = replay_slru(&t, cap, 0.8);
        let freq = replay_lru_freq(&t, cap, cap as u64 / 4);
        assert!(
            maru > 0.0 && lru > 0.0 && slru > 0.0 && freq > 0.0,
            "{maru} {lru} {slru} {freq}"
        );
        for p in [lru, maru, slru, freq] {
            assert!(belady >= p, "Belady {belady} below {p}");
        }
        // With every chunk protected-capable and no bonus, both are plain LRU.
        assert_eq!(replay_lru_freq(&t, cap, 0), lru);
    }
}
