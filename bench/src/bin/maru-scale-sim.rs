//! maru-scale-sim: simulated engines for the scale bench (`maru-bench --only scale`).
//! Each opens storage sessions at one maru-server through the worker's own session
//! client (`maru::worker::session::Session`, the wire protocol) and behaves as an
//! engine does:
//!
//! - every session heartbeats at the worker's interval (a third of the session
//!   timeout), spread evenly over the interval;
//! - prompts arrive at a fixed rate (all sessions of the process together), each on a
//!   random session: `exists` of the prompt's chunks, `acquire` of the hits and
//!   `release_leases` once they are read, `alloc` of pages for the misses (`expand`
//!   when the session's regions are full; `victims` + `remove` of its own keys when
//!   the pool gives no region: evictions once full) and `publish` of them;
//! - sessions come and go: one closes (drained, as an engine that stops) and a new
//!   one opens in its place at `--churn-per-s`.
//!
//! The prompts' hits are keys the bench published before (`fill_key`), the misses
//! new keys. It writes a ready file once its sessions are open, waits for the go
//! file, runs `--seconds`, writes every request's latency (µs) by operation as JSON to
//! `--out`, and closes its sessions.
//!
//! Beside each latency it writes how long the calling thread waited for a CPU during
//! the call (its run-queue time, `/proc/thread-self/schedstat`): on a small machine
//! the simulated engines share the cores with maru-server, and a reply that came in
//! time but found its engine's thread waiting for a core counts late. And how late
//! the threads woke for their paced turns (the machine's scheduling delay then).

use clap::Parser;
use maru::wire::meta::{Backend, PublishEntry, SkipCounts};
use maru::worker::clock::Deadline;
use maru::worker::session::Session;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every call of a simulated engine waits at most this long for maru-server.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Parser, Debug)]
#[command(
    name = "maru-scale-sim",
    about = "Simulated engines for maru-bench's scale part"
)]
struct Args {
    /// maru-server address.
    #[arg(long)]
    server: String,
    /// A tenant's key file and the namespace its sessions open in, as PATH=NAMESPACE;
    /// repeated: the sessions take them in turn.
    #[arg(long, required = true)]
    tenant: Vec<String>,
    /// Sessions this process opens.
    #[arg(long)]
    sessions: usize,
    /// A tag that tells apart the engine ids and new keys of several processes.
    #[arg(long)]
    tag: String,
    /// Prompts per second, all sessions of the process together.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Chunks of a prompt found (published by the bench before) and new.
    #[arg(long, default_value_t = 12)]
    hits: usize,
    #[arg(long, default_value_t = 4)]
    misses: usize,
    /// Keys the bench published (`fill_key(0..fill_keys)`): the prompts' hits.
    #[arg(long)]
    fill_keys: u64,
    /// Sessions that close and open again per second.
    #[arg(long, default_value_t = 1.0)]
    churn_per_s: f64,
    /// Seconds of load after the go file appears.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Written once every session is open.
    #[arg(long)]
    ready: PathBuf,
    /// Waited for before the load starts.
    #[arg(long)]
    go: PathBuf,
    /// The latencies (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Threads sending prompts.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Added to the process's nice value: engines run on hosts of their own, so on
    /// one small machine the bench lets maru-server have a CPU before them (their
    /// own wait for one is measured beside each latency).
    #[arg(long, default_value_t = 0)]
    nice: i32,
}

/// The key of the bench's `i`-th published chunk: 32 hex digits, as long as a chunk
/// hash of an engine's connector.
pub fn fill_key(i: u64) -> String {
    format!("{:016x}{:016x}", mix(i), mix(i ^ 0x5eed))
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One simulated engine: its session and the regions it stores into.
struct Engine {
    session: Session,
    regions: Mutex<Vec<u64>>,
}

type Slots = Vec<Mutex<Option<Arc<Engine>>>>;

/// Nanoseconds the calling thread has waited on a run queue for a CPU since it
/// started (`/proc/thread-self/schedstat`, its second figure); 0 when the kernel does
/// not say.
fn run_queue_ns() -> u64 {
    use std::os::unix::fs::FileExt;
    thread_local! {
        static STAT: Option<std::fs::File> = std::fs::File::open("/proc/thread-self/schedstat").ok();
    }
    STAT.with(|f| {
        let mut buf = [0u8; 96];
        let n = f
            .as_ref()
            .and_then(|f| f.read_at(&mut buf, 0).ok())
            .unwrap_or(0);
        std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|t| t.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    })
}

/// Latencies (µs) by operation, and errors by operation with the first message.
#[derive(Default, serde::Serialize)]
struct Record {
    lat: BTreeMap<&'static str, Vec<f32>>,
    /// For each latency of `lat`, the µs its thread waited for a CPU meanwhile.
    cpu_wait: BTreeMap<&'static str, Vec<f32>>,
    /// How late (µs) the paced threads woke for their turns.
    late: Vec<f32>,
    errors: BTreeMap<&'static str, (u64, String)>,
    prompts: u64,
    stored: u64,
    skipped: u64,
    evicted: u64,
}

impl Record {
    fn time<T, E: std::fmt::Display>(
        &mut self,
        op: &'static str,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Option<T> {
        let q = run_queue_ns();
        let t = Instant::now();
        let r = f();
        let us = t.elapsed().as_secs_f64() * 1e6;
        let waited = run_queue_ns().saturating_sub(q) as f64 / 1e3;
        match r {
            Ok(v) => {
                self.lat.entry(op).or_default().push(us as f32);
                self.cpu_wait.entry(op).or_default().push(waited as f32);
                Some(v)
            }
            Err(e) => {
                let slot = self.errors.entry(op).or_insert((0, e.to_string()));
                slot.0 += 1;
                None
            }
        }
    }

    fn merge(&mut self, o: Record) {
        for (k, v) in o.lat {
            self.lat.entry(k).or_default().extend(v);
        }
        for (k, v) in o.cpu_wait {
            self.cpu_wait.entry(k).or_default().extend(v);
        }
        self.late.extend(o.late);
        for (k, (n, m)) in o.errors {
            self.errors.entry(k).or_insert((0, m)).0 += n;
        }
        self.prompts += o.prompts;
        self.stored += o.stored;
        self.skipped += o.skipped;
        self.evicted += o.evicted;
    }
}

struct Ctx {
    args: Args,
    tenants: Vec<(maru::auth::SharedKey, String)>,
}

impl Ctx {
    fn open(&self, slot: usize, gen: u64) -> Result<Engine, String> {
        let (key, ns) = &self.tenants[slot % self.tenants.len()];
        let id = format!("sim-{}-{slot}-{gen}", self.args.tag);
        let session = Session::open(
            &self.args.server,
            &id,
            Some(key.clone()),
            &id,
            ns,
            "scale-bench",
            Backend::Cxl,
            CALL_TIMEOUT,
        )
        .map_err(|e| format!("session {id}: {e}"))?;
        // Block for each reply at once: thousands of sessions on two cores must not
        // spin for replies beside the server they measure.
        session.set_reply_spin(Duration::ZERO);
        Ok(Engine {
            session,
            regions: Mutex::new(Vec::new()),
        })
    }
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("maru-scale-sim: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    if args.nice != 0 {
        // SAFETY: nice(2) has no memory preconditions. -1 is also a valid result, so
        // the error is told apart by errno.
        let r = unsafe {
            *libc::__errno_location() = 0;
            libc::nice(args.nice)
        };
        if r == -1 && std::io::Error::last_os_error().raw_os_error() != Some(0) {
            return Err(format!(
                "--nice {}: {}",
                args.nice,
                std::io::Error::last_os_error()
            ));
        }
    }
    let tenants = args
        .tenant
        .iter()
        .map(|t| {
            let (path, ns) = t
                .split_once('=')
                .ok_or_else(|| format!("--tenant {t}: use PATH=NAMESPACE"))?;
            let key = maru::auth::load_key_file(std::path::Path::new(path))
                .map_err(|e| format!("{path}: {e}"))?;
            Ok((key, ns.to_string()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let ctx = Arc::new(Ctx { args, tenants });
    let n = ctx.args.sessions;
    let mut rec = Record::default();
    // Sessions open a few at a time, as engines of a pool start.
    let slots: Arc<Slots> = Arc::new((0..n).map(|_| Mutex::new(None)).collect());
    let openers: Vec<_> = (0..4)
        .map(|t| {
            let (ctx, slots) = (ctx.clone(), slots.clone());
            std::thread::spawn(move || -> Result<Record, String> {
                let mut rec = Record::default();
                for i in (t..slots.len()).step_by(4) {
                    let e = rec
                        .time("open", || ctx.open(i, 0))
                        .ok_or_else(|| format!("cannot open session {i}"))?;
                    *slots[i].lock().map_err(|_| "poisoned")? = Some(Arc::new(e));
                }
                Ok(rec)
            })
        })
        .collect();
    for o in openers {
        let r = o.join().map_err(|_| "opener panicked")??;
        // Opens before the go are not part of the measured window.
        rec.errors.extend(r.errors);
    }
    std::fs::write(&ctx.args.ready, "ready\n").map_err(|e| e.to_string())?;
    let wait = Instant::now();
    while !ctx.args.go.exists() {
        if wait.elapsed() > Duration::from_secs(600) {
            return Err("no go file within 600 s".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let beater = {
        let (ctx, slots, stop) = (ctx.clone(), slots.clone(), stop.clone());
        std::thread::spawn(move || heartbeats(&ctx, &slots, &stop))
    };
    let loaders: Vec<_> = (0..ctx.args.threads)
        .map(|t| {
            let (ctx, slots, stop) = (ctx.clone(), slots.clone(), stop.clone());
            std::thread::spawn(move || prompts(&ctx, &slots, &stop, t))
        })
        .collect();
    while start.elapsed().as_secs_f64() < ctx.args.seconds {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    let elapsed = start.elapsed().as_secs_f64();
    rec.merge(beater.join().map_err(|_| "heartbeat thread panicked")?);
    for l in loaders {
        rec.merge(l.join().map_err(|_| "prompt thread panicked")?);
    }
    let out = serde_json::json!({
        "seconds": elapsed,
        "record": rec,
    });
    std::fs::write(&ctx.args.out, out.to_string()).map_err(|e| e.to_string())?;
    for s in slots.iter() {
        if let Some(e) = s.lock().ok().and_then(|mut g| g.take()) {
            let _ = e.session.close(e.session.call_deadline());
        }
    }
    Ok(())
}

fn engine(slots: &Slots, i: usize) -> Option<Arc<Engine>> {
    slots[i].lock().ok().and_then(|g| g.clone())
}

/// `e`, once taken out of its slot, when no other thread holds it any more (their
/// prompt or heartbeat on it is over), waiting at most `within`; `None` (and a
/// warning) if one still does then: the session is left open rather than closed
/// under a request, and expires.
fn retire<T>(mut e: Arc<T>, within: Duration) -> Option<T> {
    let until = Instant::now() + within;
    loop {
        match Arc::try_unwrap(e) {
            Ok(e) => return Some(e),
            Err(back) if Instant::now() < until => {
                e = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => {
                eprintln!("maru-scale-sim: a session still in use after {within:?}: not closed");
                return None;
            }
        }
    }
}

/// Paces a loop at one turn every `every` from `start`; `k` is the next turn.
struct Turns {
    start: Instant,
    every: Duration,
    k: u32,
}

impl Turns {
    /// Turns every `every` from now.
    fn new(every: Duration) -> Turns {
        Turns {
            start: Instant::now(),
            every,
            k: 0,
        }
    }

    /// True when turn `k` is due (and `k` moves on to the next); false after a nap of
    /// at most `nap` when it is not yet, so that the caller looks at its stop flag
    /// before it asks again. A turn that comes after a nap that ended at most `nap`
    /// after it was due records in `late` how late (µs) it came: the scheduling delay
    /// of a thread that slept.
    fn due(&mut self, nap: Duration, late: &mut Vec<f32>) -> bool {
        let due = self.start + self.every * self.k;
        let now = Instant::now();
        if due > now {
            let left = due - now;
            std::thread::sleep(left.min(nap));
            if left > nap {
                return false;
            }
            // Slept until it was due: how late it woke.
            late.push(due.elapsed().as_secs_f64() as f32 * 1e6);
        }
        self.k += 1;
        true
    }
}

/// Each session heartbeats once per interval (a third of the session timeout, as a
/// worker does), the beats spread evenly over it.
fn heartbeats(ctx: &Ctx, slots: &Slots, stop: &AtomicBool) -> Record {
    let mut rec = Record::default();
    let n = slots.len().max(1);
    // (Only its timeout: an engine held here could not retire.)
    let Some(timeout_ms) =
        (0..n).find_map(|i| engine(slots, i).map(|e| e.session.session_timeout_ms))
    else {
        return rec;
    };
    let beat = Duration::from_millis((timeout_ms / 3).clamp(200, 10_000));
    let step = beat / n as u32;
    // A random phase per process.
    let mut i = (mix(ctx.args.tag.len() as u64 ^ std::process::id() as u64) as usize) % n;
    let mut turns = Turns::new(step);
    while !stop.load(Ordering::Relaxed) {
        if !turns.due(Duration::from_millis(50), &mut rec.late) {
            continue;
        }
        i = (i + 1) % n;
        if let Some(e) = engine(slots, i) {
            let regions = e.regions.lock().map(|r| r.clone()).unwrap_or_default();
            let r = rec.time("heartbeat", || {
                e.session.heartbeat(
                    BTreeMap::new(),
                    regions,
                    SkipCounts::default(),
                    Deadline::after(CALL_TIMEOUT),
                )
            });
            if let Some(r) = r {
                if !r.unknown_regions.is_empty() || !r.give_back.is_empty() {
                    if let Ok(mut mine) = e.regions.lock() {
                        mine.retain(|x| !r.unknown_regions.contains(x));
                    }
                    for rid in r.give_back {
                        let _ = e
                            .session
                            .return_region(rid, true, e.session.call_deadline());
                        if let Ok(mut mine) = e.regions.lock() {
                            mine.retain(|x| *x != rid);
                        }
                    }
                }
            }
        }
    }
    rec
}

/// Prompts at `rate / threads` per second on random sessions; thread 0 also turns
/// sessions over at the churn rate.
fn prompts(ctx: &Ctx, slots: &Slots, stop: &AtomicBool, t: usize) -> Record {
    let a = &ctx.args;
    let mut rec = Record::default();
    let mut rng = mix(std::process::id() as u64 * 977 + t as u64 + 1) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let every = Duration::from_secs_f64(a.threads as f64 / a.rate.max(0.001));
    let churn_every =
        (t == 0 && a.churn_per_s > 0.0).then(|| Duration::from_secs_f64(1.0 / a.churn_per_s));
    let mut turns = Turns::new(every);
    let mut churned: u32 = 0;
    let mut gen: u64 = 1;
    let mut fresh: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        if let Some(c) = churn_every {
            if turns.start + c * (churned + 1) <= Instant::now() {
                churned += 1;
                let i = next() as usize % slots.len();
                let old = slots[i].lock().ok().and_then(|mut g| g.take());
                // As an engine that stops: its requests in flight end first (another
                // thread may be halfway through a prompt on it), then it closes.
                if let Some(old) = old.and_then(|old| retire(old, CALL_TIMEOUT)) {
                    rec.time("close", || old.session.close(old.session.call_deadline()));
                }
                if let Some(e) = rec.time("open", || ctx.open(i, gen)) {
                    if let Ok(mut g) = slots[i].lock() {
                        *g = Some(Arc::new(e));
                    }
                }
                gen += 1;
            }
        }
        if !turns.due(Duration::from_millis(20), &mut rec.late) {
            continue;
        }
        let Some(e) = engine(slots, next() as usize % slots.len()) else {
            continue;
        };
        rec.prompts += 1;
        let base = next() % a.fill_keys.saturating_sub(a.hits as u64).max(1);
        let mut keys: Vec<String> = (0..a.hits as u64).map(|j| fill_key(base + j)).collect();
        for _ in 0..a.misses {
            fresh += 1;
            keys.push(format!("{:016x}{:016x}", mix(fresh ^ next()), fresh));
        }
        let s = &e.session;
        let Some(found) = rec.time("exists", || s.exists(&keys, s.call_deadline())) else {
            continue;
        };
        let hits: Vec<String> = keys
            .iter()
            .zip(&found)
            .filter(|(_, f)| **f)
            .map(|(k, _)| k.clone())
            .collect();
        if !hits.is_empty() {
            if let Some(leases) = rec.time("acquire", || s.acquire(&hits, s.call_deadline())) {
                let ids: Vec<u64> = leases.into_iter().flatten().map(|l| l.lease_id).collect();
                if !ids.is_empty() {
                    rec.time("release", || s.release_leases(ids, s.call_deadline()));
                }
            }
        }
        let misses: Vec<String> = keys
            .into_iter()
            .zip(&found)
            .filter(|(_, f)| !**f)
            .map(|(k, _)| k)
            .collect();
        if !misses.is_empty() {
            store(&e, &misses, &mut rec);
        }
    }
    rec
}

/// Pages for `keys` (expand when the regions are full; evict own keys when the pool
/// gives no region), then publish them; what finds no page is skipped.
fn store(e: &Engine, keys: &[String], rec: &mut Record) {
    let s = &e.session;
    let want = keys.len() as u32;
    let mut pages = Vec::new();
    for attempt in 0..3 {
        let Some((got, missing)) = rec.time("alloc", || {
            s.alloc(want - pages.len() as u32, None, s.call_deadline())
        }) else {
            return;
        };
        pages.extend(got);
        if missing == 0 || pages.len() as u32 >= want || attempt == 2 {
            break;
        }
        match rec.time("expand", || s.expand(s.call_deadline())) {
            Some(g) => {
                if let Ok(mut r) = e.regions.lock() {
                    r.push(g.handle.region_id);
                }
            }
            None => {
                // The pool is full: make room among the session's own keys.
                let Some(v) = rec.time("victims", || s.victims(missing, s.call_deadline())) else {
                    break;
                };
                if v.is_empty() {
                    break;
                }
                let names: Vec<String> = v.into_iter().map(|k| k.key).collect();
                if rec
                    .time("remove", || s.remove(&names, s.call_deadline()))
                    .is_some()
                {
                    rec.evicted += names.len() as u64;
                }
            }
        }
    }
    rec.skipped += (keys.len() - pages.len()) as u64;
    if pages.is_empty() {
        return;
    }
    let entries: Vec<PublishEntry> = keys
        .iter()
        .zip(&pages)
        .map(|(k, p)| p.entry(k.clone(), p.length))
        .collect();
    let n = entries.len() as u64;
    if rec
        .time("publish", || s.publish(entries, s.call_deadline()))
        .is_some()
    {
        rec.stored += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Turns come no faster than their pace: those already due run back to back, the
    /// next one waits (in naps no longer than asked) and does not advance `k`.
    #[test]
    fn a_turn_runs_only_once_it_is_due() {
        let mut turns = Turns::new(Duration::from_secs(3600));
        let mut late = Vec::new();
        assert!(turns.due(Duration::from_millis(1), &mut late));
        assert_eq!(turns.k, 1);
        assert!(late.is_empty(), "a turn already due came after no nap");
        let t = Instant::now();
        assert!(!turns.due(Duration::from_millis(5), &mut late));
        assert_eq!(turns.k, 1, "a turn not yet due is not counted");
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "napped at most as asked"
        );
        assert!(late.is_empty(), "a nap that ended before the turn was due");
        // A turn due within the nap: slept until then, and how late it woke is kept.
        let mut turns = Turns {
            k: 1,
            ..Turns::new(Duration::from_millis(2))
        };
        assert!(turns.due(Duration::from_millis(50), &mut late));
        assert_eq!(late.len(), 1);
        assert!(late[0] >= 0.0);
    }

    /// The churn closes a session only once the thread halfway through a prompt on
    /// it is done (the scale bench's 100-session step saw a session closed by its own
    /// churn between a prompt's `exists` and its `acquire`: "session ... is closed").
    #[test]
    fn a_session_retires_only_once_no_prompt_is_on_it() {
        let slot: Mutex<Option<Arc<AtomicBool>>> =
            Mutex::new(Some(Arc::new(AtomicBool::new(false))));
        let in_use = slot.lock().unwrap().clone().unwrap();
        let user = std::thread::spawn(move || {
            // A prompt: exists, acquire, alloc, publish on the session.
            std::thread::sleep(Duration::from_millis(100));
            in_use.store(true, Ordering::SeqCst);
        });
        let taken = slot.lock().unwrap().take().unwrap();
        let retired = retire(taken, Duration::from_secs(10)).expect("retired within 10 s");
        assert!(
            retired.load(Ordering::SeqCst),
            "closed while a prompt was still on the session"
        );
        user.join().unwrap();
        // Held past the bound: not closed at all.
        let held = Arc::new(0u8);
        let _other = held.clone();
        assert!(retire(held, Duration::from_millis(20)).is_none());
    }
}
