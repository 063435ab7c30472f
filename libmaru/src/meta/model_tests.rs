//! Many sessions against a model, on a fake clock (issue 46): seeded random runs of
//! engines that open, store (alloc, expand, publish), read, evict their own keys,
//! close drained or go silent and expire, while the clock moves and the core ticks.
//! The model is the set of keys published and not removed; the core must hold
//! exactly those (no key of a kept region lost while the pool has room), and after
//! each tick nothing may be overdue: no region a session holds unused past the
//! unused-region limit, no region on its way back that the RM could have freed, and
//! no deadline later than the earliest one the state calls for. These are what the
//! timer sets and the key directory's slab and lists must keep true; a brute-force
//! scan of the state is the oracle.

use super::fakes::*;
use super::regions::Holder;
use super::MetaConfig;
use crate::wire::meta::{MetaReply, MetaRequest, PublishEntry, MAX_BATCH};
use std::collections::BTreeMap;

/// A small xorshift generator: the runs are reproducible from their seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Engine {
    client: String,
    id: u64,
    /// Keys this engine published that the model still holds.
    keys: Vec<String>,
    /// Heartbeats and requests stop: it expires.
    silent: bool,
}

/// The world's state, checked against the model and a scan of everything.
fn check(w: &World, model: &BTreeMap<String, ()>, what: &str, after_tick: bool) {
    let core = &w.core;
    assert_eq!(
        core.keys.len(),
        model.len(),
        "{what}: keys held by the core / the model"
    );
    // The fair share's counts are those a scan of the sessions gives.
    let mut members = BTreeMap::new();
    let mut tenants: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for s in core.sessions.iter() {
        if !s.regions.is_empty() || core.fair.is_waiting(s.id) {
            members.insert(s.id, (s.tenant.clone(), s.regions.len()));
            let t = tenants.entry(s.tenant.clone()).or_default();
            t.0 += s.regions.len();
            t.1 += 1;
        }
    }
    assert_eq!(
        core.fair.counts(),
        (members, tenants),
        "{what}: the fair share's counts / a scan of the sessions"
    );
    if !after_tick {
        return;
    }
    let held: std::collections::BTreeSet<&str> = core.keys.iter().map(|(_, e)| e.name).collect();
    let want: std::collections::BTreeSet<&str> = model.keys().map(String::as_str).collect();
    assert_eq!(held, want, "{what}: keys held by the core / the model");
    let now = w.now;
    let limit = core.cfg.unused_region_ms;
    for r in core.regions.iter() {
        if let (Holder::Session(sid), Some(t)) = (r.holder, r.unused_since_ms) {
            assert!(
                now < t.saturating_add(limit),
                "{what}: region {} of session {sid} unused since {t}, limit {limit}, still \
                 held at {now}",
                r.handle.region_id
            );
        }
    }
    // The fake RM frees at once: a region on its way back at a tick is one held back
    // for a reader (durable only) or due later.
    for id in core.keeper.giving_back_ids() {
        assert!(
            !w.at_rm(id) || core.next_deadline().is_some_and(|d| d > now),
            "{what}: region {id} going back is overdue at {now}"
        );
    }
    // Regions at the RM: those in the table (held, kept or going back), no other.
    let at_rm: Vec<u64> = w.rm.allocated.keys().copied().collect();
    let known: Vec<u64> = core.regions.iter().map(|r| r.handle.region_id).collect();
    assert_eq!(at_rm, known, "{what}: regions at the RM / in the table");
    // Kept regions hold keys; regions going back hold none.
    for r in core.regions.iter() {
        let rid = r.handle.region_id;
        match r.holder {
            Holder::Keeper => assert!(
                core.keys.region_keys(rid) > 0 && core.keeper.is_kept(rid),
                "{what}: kept region {rid} without keys"
            ),
            Holder::GivingBack => assert_eq!(
                core.keys.region_keys(rid),
                0,
                "{what}: region {rid} going back holds keys"
            ),
            Holder::Session(_) => {}
        }
    }
    // The next deadline is no later than the earliest due time the state has.
    let unused_due = core
        .regions
        .iter()
        .filter_map(|r| match (r.holder, r.unused_since_ms) {
            (Holder::Session(_), Some(t)) => Some(t.saturating_add(limit)),
            _ => None,
        })
        .min();
    if let Some(d) = unused_due {
        assert!(
            core.next_deadline().is_some_and(|n| n <= d),
            "{what}: a region goes back unused at {d}, the next deadline is {:?}",
            core.next_deadline()
        );
    }
}

/// Stores `n` new keys through engine `e`: alloc, expand while pages are missing (a
/// refused expand ends the store there), publish what it got.
fn store(w: &mut World, e: &mut Engine, model: &mut BTreeMap<String, ()>, n: u32, seq: &mut u64) {
    let mut pages = Vec::new();
    let mut tries = 0;
    while (pages.len() as u32) < n && tries < 4 {
        tries += 1;
        let want = n - pages.len() as u32;
        let r = w.req(
            &e.client,
            MetaRequest::Alloc {
                session: e.id,
                count: want,
                route_key: None,
            },
        );
        let Ok(MetaReply::Pages(p)) = r else {
            panic!("alloc: {r:?}");
        };
        pages.extend(p.pages);
        if p.missing > 0
            && w.req(&e.client, MetaRequest::Expand { session: e.id })
                .is_err()
        {
            break;
        }
    }
    if pages.is_empty() {
        return;
    }
    let mut entries = Vec::new();
    let mut prev: Option<String> = None;
    for p in &pages {
        *seq += 1;
        let key = format!("{}-{seq}", e.client);
        entries.push(PublishEntry {
            key: key.clone(),
            region_id: p.region_id,
            offset: p.offset,
            length: 1000,
            // Chains of a few keys, as prompts are.
            prev: prev.take().filter(|_| *seq % 4 != 0),
        });
        prev = Some(key);
    }
    let names: Vec<String> = entries.iter().map(|x| x.key.clone()).collect();
    let is_new = w.publish_at(&e.client, e.id, entries).unwrap();
    assert!(is_new.iter().all(|x| *x));
    for k in names {
        model.insert(k.clone(), ());
        e.keys.push(k);
    }
}

/// One seeded run: up to `max_live` engines, `steps` operations, a pool of
/// `regions` regions (ample: no key has to go for room).
fn run(seed: u64, max_live: usize, regions: u64, steps: usize) {
    let cfg = MetaConfig {
        max_sessions: 4 * max_live + 16,
        unused_region_ms: 3_000,
        ..config(&[])
    };
    let timeout = cfg.session_timeout_ms;
    let mut w = World::with(cfg, regions * REGION);
    let mut rng = Rng(seed | 1);
    let mut model: BTreeMap<String, ()> = BTreeMap::new();
    let mut engines: Vec<Engine> = Vec::new();
    let (mut opened, mut seq) = (0u64, 0u64);
    for step in 0..steps {
        let what = format!("seed {seed} step {step}");
        let live = engines.iter().filter(|e| !e.silent).count();
        let op = rng.below(100);
        let mut ticked = false;
        match op {
            0..=9 if live < max_live => {
                opened += 1;
                let client = format!("engine-{opened}:1");
                let id = w.open_without_region(&client);
                engines.push(Engine {
                    client,
                    id,
                    keys: Vec::new(),
                    silent: false,
                });
            }
            10..=44 if live > 0 => {
                let i = pick_live(&mut rng, &engines);
                let n = 1 + rng.below(12) as u32;
                let mut e = std::mem::replace(&mut engines[i], placeholder());
                store(&mut w, &mut e, &mut model, n, &mut seq);
                engines[i] = e;
            }
            45..=52 if live > 0 => {
                // Evicts some of its own keys, as `victims` offers them: every key
                // of its regions, none other (each region's order reaches all).
                let i = pick_live(&mut rng, &engines);
                let e = &mut engines[i];
                let max = (e.keys.len() + 4).min(MAX_BATCH) as u32;
                let offered = w.victims(&e.client, e.id, max);
                let mut mine = e.keys.clone();
                let mut got = offered.clone();
                mine.sort();
                got.sort();
                if e.keys.len() + 4 <= MAX_BATCH {
                    assert_eq!(got, mine, "{what}: victims offered / the engine's keys");
                }
                let take = (rng.below(8) as usize).min(offered.len());
                let gone: Vec<String> = offered[..take].to_vec();
                e.keys.retain(|k| !gone.contains(k));
                if !gone.is_empty() {
                    let r = w.req(
                        &e.client,
                        MetaRequest::Remove {
                            session: e.id,
                            keys: gone.clone(),
                        },
                    );
                    assert!(r.is_ok(), "{what}: remove: {r:?}");
                    for k in gone {
                        model.remove(&k);
                    }
                }
            }
            53..=60 if live > 0 => {
                // Reads: exists of some keys of the model.
                let i = pick_live(&mut rng, &engines);
                let e = &engines[i];
                let keys: Vec<&str> = model
                    .keys()
                    .skip(rng.below(model.len() as u64) as usize)
                    .take(8)
                    .map(String::as_str)
                    .collect();
                if !keys.is_empty() {
                    let found = w.exists(&e.client.clone(), e.id, &keys);
                    assert!(found.iter().all(|f| *f), "{what}: {keys:?} found {found:?}");
                }
            }
            61..=65 if live > 0 => {
                let i = pick_live(&mut rng, &engines);
                let e = engines.remove(i);
                w.close(&e.client, e.id, true);
                // Its keys stay (kept by the keeper).
            }
            66..=68 if live > 0 => {
                let i = pick_live(&mut rng, &engines);
                engines[i].silent = true;
            }
            _ => {
                // The clock moves; live engines heartbeat; the core ticks.
                let ms = 1 + rng.below(2_500);
                w.now += ms;
                for e in engines.iter().filter(|e| !e.silent) {
                    w.heartbeat(&e.client.clone(), e.id, &[]);
                }
                w.tick();
                ticked = true;
                // Silent engines are gone once their session expired.
                let core = &w.core;
                engines.retain(|e| !e.silent || core.sessions.get(e.id).is_some());
            }
        }
        check(&w, &model, &what, ticked);
    }
    // Everyone leaves; their keys stay kept; everything else goes back.
    for e in std::mem::take(&mut engines) {
        if !e.silent {
            w.close(&e.client, e.id, true);
        }
    }
    for _ in 0..20 {
        w.now += timeout;
        w.tick();
    }
    check(&w, &model, &format!("seed {seed} at the end"), true);
    assert_eq!(w.core.session_count(), 0);
    // What is left at the RM is the kept regions, each with keys.
    assert_eq!(
        w.core.keeper.giving_back_len(),
        0,
        "seed {seed}: regions still going back"
    );
    assert_eq!(
        w.rm.allocated.len(),
        w.core.keeper.kept_len(),
        "seed {seed}: regions at the RM / kept"
    );
}

fn pick_live(rng: &mut Rng, engines: &[Engine]) -> usize {
    let live: Vec<usize> = (0..engines.len()).filter(|&i| !engines[i].silent).collect();
    live[rng.below(live.len() as u64) as usize]
}

fn placeholder() -> Engine {
    Engine {
        client: String::new(),
        id: 0,
        keys: Vec::new(),
        silent: true,
    }
}

#[test]
fn many_sessions_keep_every_key_they_published_and_nothing_is_overdue() {
    for seed in 1..=8u64 {
        run(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 24, 4096, 1_500);
    }
}
