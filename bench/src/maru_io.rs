//! Maru store and load through the C ABI (`maru_handler_open`, `maru_store_batch`,
//! `maru_load_batch`, `maru_store`, `maru_load`, and loads into staging slots with
//! `maru_slots_acquire` / `maru_load_slots` / `maru_slots_release`, the zero-copy path
//! where the runtime's own kernel copies slot → GPU): the calls an inference runtime
//! makes after dlopen, here linked from Rust. Each configuration gets a fresh RM + agent +
//! maru-server over the same pre-faulted fake-DAX pool, with pages of the chunk size.

use crate::harness::{alternate, run_clients, run_clients_raw, Bound, Fig, Rotor, Run};
use crate::procs::{stack, Scratch};
use maru::ffi::{
    maru_handler_close, maru_handler_open, maru_handler_t, maru_load, maru_load_batch,
    maru_load_slots, maru_remove_batch, maru_remove_result_t, maru_slot_pool_t, maru_slot_t,
    maru_slots_acquire, maru_slots_release, maru_status_t, maru_store, maru_store_batch,
};
use serde::Serialize;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex};

pub use crate::harness::BATCH;

/// The keys (named by `key`) and destinations of batch `b` of a batched load: the
/// chunks `b * BATCH ..` a client stored in batches, each read into the next buffer
/// of `dst`.
fn load_batch_args(
    dst: &Mutex<Rotor>,
    key: impl Fn(usize) -> CString,
    b: usize,
) -> Result<(Vec<CString>, Vec<*mut u8>), String> {
    let keys = (0..BATCH).map(|j| key(b * BATCH + j)).collect();
    let mut r = dst.lock().map_err(|_| "poisoned".to_string())?;
    let bufs = (0..BATCH).map(|_| r.next_ptr()).collect();
    Ok((keys, bufs))
}

/// One client of a Maru figure: its handler, its rotors of sources and destinations,
/// its keys (`tag(client, kind, i)`) and the chunk size; each method makes the op of
/// one kind of call for [`run_clients`] (the Mooncake part's Maru turns make theirs
/// here too).
pub struct ClientOps<T> {
    pub h: Arc<CHandler>,
    pub c: usize,
    pub src: Arc<Mutex<Rotor>>,
    pub dst: Arc<Mutex<Rotor>>,
    pub tag: T,
    pub chunk: usize,
}

/// The two load phases over the batches each client `c` stored (`stored[c]`, from the
/// ops `client(c)` makes): batched loads, then single loads of their chunks, each
/// until `bound`.
pub fn load_phases<T>(
    client: impl Fn(usize) -> ClientOps<T>,
    stored: &[usize],
    bound: Bound,
) -> Result<[Run; 2], String>
where
    T: Fn(usize, &str, usize) -> CString + Send + 'static,
{
    let batched: Vec<_> = (0..stored.len())
        .map(|c| client(c).load_batch(stored[c]))
        .collect();
    let batched = run_clients_raw(batched, bound)?;
    let single: Vec<_> = (0..stored.len())
        .map(|c| client(c).load_single(stored[c]))
        .collect();
    Ok([batched, run_clients_raw(single, bound)?])
}

/// An op for [`run_clients`]: call `i` moves the bytes it returns.
pub trait ClientOp: FnMut(usize) -> Result<u64, String> + Send + 'static {}
impl<F: FnMut(usize) -> Result<u64, String> + Send + 'static> ClientOp for F {}

impl<T: Fn(usize, &str, usize) -> CString + Send + 'static> ClientOps<T> {
    /// Single stores of `len` bytes each, a new key (kind `s`) every call.
    pub fn store_single(self, len: usize) -> impl ClientOp {
        move |i: usize| -> Result<u64, String> {
            let p = self.src.lock().map_err(|_| "poisoned")?.next_ptr() as *const u8;
            self.h.store_one(&(self.tag)(self.c, "s", i), p, len)?;
            Ok(len as u64)
        }
    }

    /// Batched loads of the `batches` batches the client stored (kind `b`), in
    /// rotation.
    pub fn load_batch(self, batches: usize) -> impl ClientOp {
        let n = batches.max(1);
        move |i: usize| -> Result<u64, String> {
            let (keys, bufs) = load_batch_args(&self.dst, |k| (self.tag)(self.c, "b", k), i % n)?;
            self.h.load_batch(&keys, &bufs, self.chunk)
        }
    }

    /// Single loads of the chunks of those batches, in rotation.
    pub fn load_single(self, batches: usize) -> impl ClientOp {
        let n = batches.max(1) * BATCH;
        move |i: usize| -> Result<u64, String> {
            let p = self.dst.lock().map_err(|_| "poisoned")?.next_ptr();
            self.h
                .load_one(&(self.tag)(self.c, "b", i % n), p, self.chunk)
        }
    }
}

/// Turns each of "store, reused pages" and "store into a full cache" takes, each of
/// a quarter of a figure's seconds.
const TURNS: usize = 8;
pub const MIB: usize = 1 << 20;

/// An open handler; closed on drop.
pub struct CHandler(*mut maru_handler_t);

// SAFETY: the C ABI documents the handler as thread-safe (calls from several threads
// may run at once); the pointer is only freed in Drop, after every user is gone.
unsafe impl Send for CHandler {}
unsafe impl Sync for CHandler {}

/// `Ok` for `MARU_OK`; otherwise the call `what`, the status and libmaru's last error.
pub fn check(st: maru_status_t, what: &str) -> Result<(), String> {
    if st == maru_status_t::MARU_OK {
        return Ok(());
    }
    let msg = maru::ffi::last_error().map(|(_, m)| m).unwrap_or_default();
    Err(format!("{what}: {st:?}: {msg}"))
}

/// `Ok` when every entry of `flags` (a call's outcome per chunk) is set; otherwise the
/// error `what` makes of how many are not, of how many.
pub fn every_set(flags: &[bool], what: impl FnOnce(usize, usize) -> String) -> Result<(), String> {
    match flags.iter().filter(|&&f| !f).count() {
        0 => Ok(()),
        n => Err(what(n, flags.len())),
    }
}

/// The C pointers of `keys`, valid while `keys` lives.
pub fn key_ptrs(keys: &[CString]) -> Vec<*const c_char> {
    keys.iter().map(|k| k.as_ptr()).collect()
}

impl CHandler {
    /// The handler, for the calls this wrapper has no method for.
    pub fn as_ptr(&self) -> *mut maru_handler_t {
        self.0
    }

    pub fn open(cfg: &str) -> Result<CHandler, String> {
        let c = CString::new(cfg).map_err(|e| e.to_string())?;
        let mut h = std::ptr::null_mut();
        // SAFETY: a NUL-terminated config and a writable out pointer.
        check(
            unsafe { maru_handler_open(c.as_ptr(), &mut h) },
            "maru_handler_open",
        )?;
        Ok(CHandler(h))
    }

    /// Stores `ptrs[i]` (`len` bytes each) under `keys[i]`; all must be stored.
    pub fn store_batch(
        &self,
        keys: &[CString],
        ptrs: &[*const u8],
        len: usize,
    ) -> Result<(), String> {
        let kp = key_ptrs(keys);
        let lens = vec![len; keys.len()];
        let mut stored = vec![false; keys.len()];
        // SAFETY: arrays of keys.len() entries; each pointer has `len` readable bytes.
        check(
            unsafe {
                maru_store_batch(
                    self.0,
                    kp.as_ptr(),
                    ptrs.as_ptr(),
                    lens.as_ptr(),
                    keys.len(),
                    kp[0],
                    stored.as_mut_ptr(),
                )
            },
            "maru_store_batch",
        )?;
        every_set(&stored, |n, of| {
            format!(
                "maru_store_batch skipped {n} of {of} chunks; the handler's counters: {}",
                self.counters_for_error()
            )
        })
    }

    pub fn store_one(&self, key: &CString, ptr: *const u8, len: usize) -> Result<(), String> {
        let mut stored = false;
        // SAFETY: `ptr` has `len` readable bytes.
        check(
            unsafe {
                maru_store(
                    self.0,
                    key.as_ptr(),
                    ptr,
                    len,
                    std::ptr::null(),
                    &mut stored,
                )
            },
            "maru_store",
        )?;
        if stored {
            Ok(())
        } else {
            Err(format!(
                "maru_store skipped the chunk; the handler's counters: {}",
                self.counters_for_error()
            ))
        }
    }

    /// Loads `keys` into load staging slots (taken for the call, given back after):
    /// what a runtime does before its own kernel copies each slot to the GPU. All must
    /// be found; the bytes are not copied out of the slots.
    pub fn load_slots_batch(&self, keys: &[CString]) -> Result<u64, String> {
        let n = keys.len();
        let mut slots = vec![
            maru_slot_t {
                id: 0,
                data: std::ptr::null_mut(),
                capacity: 0,
            };
            n
        ];
        let mut got = 0usize;
        // SAFETY: `slots` has n writable entries and `got` is writable.
        check(
            unsafe {
                maru_slots_acquire(
                    self.0,
                    maru_slot_pool_t::MARU_SLOT_LOAD.into(),
                    n,
                    5000,
                    slots.as_mut_ptr(),
                    &mut got,
                )
            },
            "maru_slots_acquire",
        )?;
        let ids: Vec<u64> = slots[..got].iter().map(|s| s.id).collect();
        let loaded = if got < n {
            Err(format!("maru_slots_acquire gave {got} of {n} load slots"))
        } else {
            let kp = key_ptrs(keys);
            let mut lens = vec![0usize; n];
            let mut found = vec![false; n];
            // SAFETY: arrays of n entries; the slot ids are held by this thread.
            check(
                unsafe {
                    maru_load_slots(
                        self.0,
                        kp.as_ptr(),
                        ids.as_ptr(),
                        n,
                        kp[0],
                        lens.as_mut_ptr(),
                        found.as_mut_ptr(),
                    )
                },
                "maru_load_slots",
            )
            .and_then(|()| {
                every_set(&found, |m, of| {
                    format!("maru_load_slots missed {m} of {of} stored chunks")
                })
            })
            .map(|()| lens.iter().sum::<usize>() as u64)
        };
        // SAFETY: `ids` are the slots taken above.
        check(
            unsafe { maru_slots_release(self.0, ids.as_ptr(), ids.len()) },
            "maru_slots_release",
        )?;
        loaded
    }

    /// Unpublishes `keys` (this handler stored them); all must be removed.
    pub fn remove_batch(&self, keys: &[CString]) -> Result<(), String> {
        let kp = key_ptrs(keys);
        let mut res = vec![maru_remove_result_t::MARU_REMOVE_NOT_FOUND; keys.len()];
        // SAFETY: arrays of keys.len() entries.
        check(
            unsafe { maru_remove_batch(self.0, kp.as_ptr(), kp.len(), kp[0], res.as_mut_ptr()) },
            "maru_remove_batch",
        )?;
        match res
            .iter()
            .filter(|&&r| r != maru_remove_result_t::MARU_REMOVED)
            .count()
        {
            0 => Ok(()),
            n => Err(format!("maru_remove_batch kept {n} of {} keys", keys.len())),
        }
    }

    /// Loads `keys[i]` into `bufs[i]` (`cap` bytes each); all must be found.
    pub fn load_batch(
        &self,
        keys: &[CString],
        bufs: &[*mut u8],
        cap: usize,
    ) -> Result<u64, String> {
        let kp = key_ptrs(keys);
        let caps = vec![cap; keys.len()];
        let mut lens = vec![0usize; keys.len()];
        let mut found = vec![false; keys.len()];
        // SAFETY: arrays of keys.len() entries; each buffer has `cap` writable bytes.
        check(
            unsafe {
                maru_load_batch(
                    self.0,
                    kp.as_ptr(),
                    bufs.as_ptr(),
                    caps.as_ptr(),
                    lens.as_mut_ptr(),
                    found.as_mut_ptr(),
                    keys.len(),
                    kp[0],
                )
            },
            "maru_load_batch",
        )?;
        every_set(&found, |n, of| {
            format!("maru_load_batch missed {n} of {of} stored chunks")
        })?;
        Ok(lens.iter().sum::<usize>() as u64)
    }

    pub fn load_one(&self, key: &CString, buf: *mut u8, cap: usize) -> Result<u64, String> {
        let mut len = 0usize;
        // SAFETY: `buf` has `cap` writable bytes.
        check(
            unsafe { maru_load(self.0, key.as_ptr(), buf, cap, &mut len, std::ptr::null()) },
            "maru_load",
        )?;
        Ok(len as u64)
    }
}

impl CHandler {
    /// The handler's counters (`maru_stats_json`).
    pub fn stats(&self) -> Result<serde_json::Value, String> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut len = 0usize;
        // SAFETY: a writable buffer of `buf.len()` bytes and an out pointer.
        check(
            unsafe {
                maru::ffi::maru_stats_json(self.0, buf.as_mut_ptr().cast(), buf.len(), &mut len)
            },
            "maru_stats_json",
        )?;
        serde_json::from_slice(&buf[..len.min(buf.len())]).map_err(|e| format!("stats: {e}"))
    }

    /// The handler's counters for an error message (why chunks were skipped).
    fn counters_for_error(&self) -> String {
        match self.stats() {
            Ok(v) => v["total"].to_string(),
            Err(e) => format!("(unreadable: {e})"),
        }
    }

    /// Waits (up to 10 s) until the handler's background prefaulting of its regions
    /// (`cxl`) has settled, so that an idle figure measures idleness, not that work.
    pub fn settle_prefault(&self) -> Result<(), String> {
        let read = || -> Result<u64, String> {
            Ok(self.stats()?["total"]["prefaulted_bytes"]
                .as_u64()
                .unwrap_or(0))
        };
        let mut last = read()?;
        let mut calm = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while calm < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let now = read()?;
            calm = if now == last { calm + 1 } else { 0 };
            last = now;
        }
        Ok(())
    }
}

impl Drop for CHandler {
    fn drop(&mut self) {
        // SAFETY: a handler from maru_handler_open, closed once.
        let _ = unsafe { maru_handler_close(self.0) };
    }
}

/// Staging slots of the benchmark's handlers: one batch in flight, unless overridden
/// (to try other pipeline depths) by the environment variable `var`.
fn slots(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A handler's configuration for the stack of scratch `s` (its maru-server key, and
/// its agent key for remote_cxl).
pub fn handler_config(server: &str, backend: &str, engine: &str, s: &Scratch) -> String {
    let mut c = serde_json::json!({
        "backend": backend,
        "server_url": server,
        "server_key_file": s.server_key.display().to_string(),
        "engine_id": engine,
        "namespace": "bench",
        "load_slots": slots("MARU_BENCH_LOAD_SLOTS", BATCH),
        "store_slots": slots("MARU_BENCH_STORE_SLOTS", BATCH),
    });
    // How long a call polls for maru-server's reply (the handler's default unless
    // set): to measure polling against one blocking read side by side.
    if let Some(us) = std::env::var("MARU_BENCH_REPLY_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        c["reply_spin_us"] = us.into();
    }
    if backend == "remote_cxl" {
        c["transport"] = "soft".into();
        c["agent_key_file"] = s.key_file.display().to_string().into();
    }
    c.to_string()
}

/// One configuration: `handlers` engines, each used by `threads` threads at once.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Config {
    pub backend: &'static str,
    pub chunk: usize,
    pub handlers: usize,
    pub threads: usize,
}

impl Config {
    pub fn clients(&self) -> usize {
        self.handlers * self.threads
    }
}

/// The figures of one configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Result_ {
    pub config: Config,
    pub store_batch: Fig,
    pub store_single: Fig,
    pub load_batch: Fig,
    pub load_single: Fig,
    /// Batched loads into staging slots (no copy out); only with one thread per
    /// handler, whose load slots hold one batch.
    pub load_slots: Option<Fig>,
    /// Batched stores into pages used before, on the full pool (each batch removed
    /// after it is stored, and the next stored into the pages it freed): the copy and
    /// publish without choosing victims. The time includes the remove (one round trip).
    /// Measured in turns with `store_full`.
    pub store_reused: Fig,
    /// store_full / store_reused of each turn, sorted (the target reads the median).
    pub full_vs_reused: Vec<f64>,
    /// Batched stores of new keys into a full pool: each store that finds no free
    /// page evicts keys of its engine's regions (`victims` → `remove`) and reuses
    /// their pages.
    pub store_full: Fig,
}

impl Result_ {
    /// The median of the turns' full-cache / reused-pages ratios.
    pub fn full_vs_reused_median(&self) -> f64 {
        crate::harness::percentile(&self.full_vs_reused, 0.5)
    }
}

pub struct Sizes {
    /// Seconds per figure.
    pub secs: f64,
    /// Source/destination memory each client rotates over.
    pub rotate: usize,
    /// Region size at maru-server.
    pub region: usize,
    /// Bytes each chunk of the stores and loads moves: the chunk size, or (`--null-copy`)
    /// [`NULL_COPY_BYTES`] into pages of the chunk size, so that a call does all its
    /// work but the copy.
    pub payload: usize,
}

/// Bytes per chunk of a null-copy figure (one cache line).
pub const NULL_COPY_BYTES: usize = 64;

/// Runs the four figures of `cfg` on a fresh stack.
pub fn run(s: &Scratch, cfg: Config, sz: &Sizes) -> Result<Result_, String> {
    let st = stack(
        s,
        cfg.backend == "remote_cxl",
        &format!("{}", sz.region),
        &format!("{}", cfg.chunk),
    )?;
    let handlers: Vec<Arc<CHandler>> = (0..cfg.handlers)
        .map(|i| {
            CHandler::open(&handler_config(
                &st.server,
                cfg.backend,
                &format!("bench-{}-{}", cfg.backend, i),
                s,
            ))
            .map(Arc::new)
        })
        .collect::<Result<_, _>>()?;
    let clients = cfg.clients();
    // Space: stores of the figures before the full-cache one stay within what fits,
    // with two regions per session to spare (one partly filled, one taken ahead of
    // need), so that they measure stores without eviction.
    let usable = (s.pool_size as usize)
        .saturating_sub(sz.region * (2 * cfg.handlers + 2))
        .max(cfg.chunk * BATCH * 2 * clients);
    let per_client_chunks = usable / cfg.chunk / clients;
    let batch_ops = (per_client_chunks * 3 / 4) / BATCH;
    let single_ops = per_client_chunks - batch_ops * BATCH - BATCH;
    let chunk = cfg.chunk;
    let len = sz.payload.min(chunk);
    let tag = move |c: usize, kind: &str, i: usize| {
        CString::new(format!("{}-{}-{kind}-{c}-{i}", cfg.backend, chunk)).unwrap_or_default()
    };
    let client_handler = |c: usize| handlers[c / cfg.threads].clone();
    // Warm-up (staging pages, connections, first region): one batch per client.
    for c in 0..clients {
        let h = client_handler(c);
        let src = Rotor::new(chunk * BATCH, chunk, c as u64);
        let keys: Vec<CString> = (0..BATCH).map(|i| tag(c, "warm", i)).collect();
        let ptrs: Vec<*const u8> = (0..BATCH)
            // SAFETY: i < BATCH pieces of `chunk` bytes each lie inside the rotor.
            .map(|i| unsafe { src.base().add(i * chunk) })
            .collect();
        h.store_batch(&keys, &ptrs, len)?;
        let mut dst = Rotor::new(chunk * BATCH, chunk, 0);
        let bufs: Vec<*mut u8> = (0..BATCH).map(|_| dst.next_ptr()).collect();
        h.load_batch(&keys, &bufs, chunk)?;
    }
    let bound = |max_ops| Bound {
        secs: sz.secs,
        max_ops,
    };
    // A null-copy figure's sources and destinations are two pieces, in the caches:
    // its 64 bytes from or into cold memory beyond the caches cost a cache and TLB
    // miss on each side (about 2 µs a chunk on the bench VM), which a copy of the
    // chunk pays as part of its copy, at the limit's rate.
    let rotate = if len < chunk { 2 * chunk } else { sz.rotate };
    let srcs: Vec<Arc<Mutex<Rotor>>> = (0..clients)
        .map(|c| Arc::new(Mutex::new(Rotor::new(rotate, chunk, 7 + c as u64))))
        .collect();
    let dsts: Vec<Arc<Mutex<Rotor>>> = (0..clients)
        .map(|_| Arc::new(Mutex::new(Rotor::new(rotate, chunk, 3))))
        .collect();
    // How many batches each client's batched stores stored.
    let counts = Arc::new(Mutex::new(vec![0usize; clients]));
    // Batches of 32 new keys (`kind`), one call per client; with `remove`, each batch
    // removed after it is stored, so that the next goes into the pages it freed ("store,
    // reused pages": in a full pool the pages a remove frees are the next ones handed
    // out); without it, stores that evict once the pool is full ("store into a full
    // cache").
    let store_ops = |kind: String, remove: bool| -> Vec<_> {
        (0..clients)
            .map(|c| {
                let h = client_handler(c);
                let src = srcs[c].clone();
                let kind = kind.clone();
                move |i: usize| -> Result<u64, String> {
                    let keys: Vec<CString> =
                        (0..BATCH).map(|j| tag(c, &kind, i * BATCH + j)).collect();
                    let ptrs: Vec<*const u8> = {
                        let mut r = src.lock().map_err(|_| "poisoned")?;
                        (0..BATCH).map(|_| r.next_ptr() as *const u8).collect()
                    };
                    h.store_batch(&keys, &ptrs, len)?;
                    if remove {
                        h.remove_batch(&keys)?;
                    }
                    Ok((BATCH * len) as u64)
                }
            })
            .collect()
    };
    let reused_ops = |kind: String| store_ops(kind, true);
    let full_ops = |kind: String| store_ops(kind, false);
    // Batched stores: new keys each batch, counted (the loads read them back).
    let ops_batch: Vec<_> = full_ops("b".into())
        .into_iter()
        .enumerate()
        .map(|(c, op)| {
            let counts = counts.clone();
            move |i: usize| -> Result<u64, String> {
                let moved = op(i)?;
                if let Ok(mut n) = counts.lock() {
                    n[c] = i + 1;
                }
                Ok(moved)
            }
        })
        .collect();
    // Not measured: a region's worth of batches per client stored and removed, the
    // handlers' background prefaulting of the regions taken settled, and a figure's
    // seconds more of stores and removes, so that the figures start on a handler past
    // its first use, as they did when "store, reused pages" was measured here (with
    // no warm-up at all, a full run measured cxl 2 MiB x 1 client at 4.9 GB/s with a
    // p99 of 203 ms; with the first two steps only, 11.8 and 17.7 in focused runs,
    // 22.0 with the third).
    let warm_cycles = sz.region / (chunk * BATCH) + 2;
    for (c, op) in reused_ops("warm".into()).into_iter().enumerate() {
        for i in 0..warm_cycles {
            op(c * warm_cycles + i)?;
        }
    }
    for h in &handlers {
        h.settle_prefault()?;
    }
    run_clients(reused_ops("warm-more".into()), bound(usize::MAX))?;
    let store_batch = run_clients(ops_batch, bound(batch_ops.max(1)))?;
    let stored: Vec<usize> = counts.lock().map_err(|_| "poisoned")?.clone();
    let client = |c: usize| ClientOps {
        h: client_handler(c),
        c,
        src: srcs[c].clone(),
        dst: dsts[c].clone(),
        tag,
        chunk,
    };
    // Single stores.
    let ops: Vec<_> = (0..clients).map(|c| client(c).store_single(len)).collect();
    let store_single = run_clients(ops, bound(single_ops.max(1)))?;
    // Batched loads over the keys each client stored in batches, in rotation.
    let [load_batch, load_single] = load_phases(client, &stored, bound(usize::MAX))?.map(Run::fig);
    let load_slots = if cfg.threads == 1 {
        let ops: Vec<_> = (0..clients)
            .map(|c| {
                let h = client_handler(c);
                let n = stored[c].max(1);
                move |i: usize| -> Result<u64, String> {
                    let b = i % n;
                    let keys: Vec<CString> =
                        (0..BATCH).map(|j| tag(c, "b", b * BATCH + j)).collect();
                    h.load_slots_batch(&keys)
                }
            })
            .collect();
        Some(run_clients(ops, bound(usize::MAX))?)
    } else {
        None
    };
    // A full cache: new keys until the pool is full (not measured), then stores that
    // evict to find their pages.
    let fill_batches = s.pool_size as usize / (chunk * BATCH) / clients + 2;
    for (c, op) in full_ops("fill".into()).into_iter().enumerate() {
        for i in 0..fill_batches {
            op(c * fill_batches + i)?;
        }
    }
    // The two figures whose ratio is the cost of eviction take turns on the full pool
    // (the order swapped every turn), so that the machine's drift over the seconds
    // they take weighs on both alike.
    let turn = Bound {
        secs: sz.secs / 4.0,
        max_ops: usize::MAX,
    };
    let (reused_turns, full_turns) = alternate(TURNS, |is_full, t| {
        if is_full {
            run_clients_raw(full_ops(format!("full{t}")), turn)
        } else {
            run_clients_raw(reused_ops(format!("r{t}")), turn)
        }
    })?;
    let mut full_vs_reused: Vec<f64> = reused_turns
        .iter()
        .zip(&full_turns)
        .map(|(r, f)| f.rate() / r.rate().max(1e-9))
        .collect();
    full_vs_reused.sort_by(|a, b| a.total_cmp(b));
    let (mut reused, mut full) = (Run::default(), Run::default());
    reused_turns.into_iter().for_each(|r| reused.add(r));
    full_turns.into_iter().for_each(|f| full.add(f));
    let (store_reused, store_full) = (reused.fig(), full.fig());
    drop(handlers);
    drop(st);
    Ok(Result_ {
        config: cfg,
        store_batch,
        store_single,
        load_batch,
        load_single,
        load_slots,
        store_reused,
        full_vs_reused,
        store_full,
    })
}

#[cfg(test)]
mod tests {
    use super::every_set;

    #[test]
    fn a_call_fails_when_any_chunk_is_not_set_and_says_how_many() {
        let what = |n, of| format!("{n} of {of}");
        assert_eq!(every_set(&[true, true], what), Ok(()));
        assert_eq!(every_set(&[], what), Ok(()));
        assert_eq!(every_set(&[true, false, false], what), Err("2 of 3".into()));
    }
}
