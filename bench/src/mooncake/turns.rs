//! One turn of the `mooncake` part per system: Mooncake's (its client processes,
//! bench/python/mooncake_row.py `run`) and Maru's on a fresh stack, the same five
//! phases on both sides (batch put, single put, batch get, single get, exists).

use super::cluster::{run_bounded, script, Cluster};
use crate::harness::{run_clients_raw, Bound, Rotor, Run};
use crate::maru_io::{
    check, every_set, handler_config, key_ptrs, load_phases, CHandler, ClientOps, BATCH,
};
use crate::procs::{stack, with_parent, Scratch};
use serde::Deserialize;
use std::ffi::CString;
use std::io::Read;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// maru-server's region size on Maru's side.
const REGION: usize = 256 << 20;

/// What mooncake_row.py run prints, per phase.
#[derive(Deserialize)]
struct PyPhase {
    bytes: u64,
    wall: f64,
    lat: Vec<f64>,
}

impl From<PyPhase> for Run {
    fn from(p: PyPhase) -> Run {
        Run {
            bytes: p.bytes,
            wall: p.wall,
            lat: p.lat,
        }
    }
}

/// The five phases' runs, in the order of [`Row`]'s figures.
pub(super) type Turn = [Run; 5];

#[allow(clippy::too_many_arguments)]
pub(super) fn mooncake_turn(
    m: &Cluster,
    chunk: usize,
    clients: usize,
    secs: f64,
    rotate: usize,
    segment: u64,
    tag: &str,
) -> Result<Turn, String> {
    // Puts stay under Mooncake's eviction watermark (0.9 of the segment): 3/4 of each
    // client's share in batches, the rest single.
    let per_client = (segment as usize * 7 / 10) / chunk / clients;
    let max_batches = (per_client * 3 / 4 / BATCH).max(1);
    let max_singles = per_client.saturating_sub(max_batches * BATCH).max(1);
    let out = m.logs.join(format!("{tag}.json"));
    let log = m.logs.join(format!("{tag}.log"));
    run_bounded(
        with_parent(Command::new(&m.py))
            .arg(script()?)
            .args([
                "run",
                "--master",
                &m.master_addr,
                "--metadata",
                &m.metadata_url,
            ])
            .args(["--chunk", &chunk.to_string()])
            .args(["--clients", &clients.to_string()])
            .args(["--secs", &secs.to_string()])
            .args(["--rotate", &rotate.to_string()])
            .args(["--max-batches", &max_batches.to_string()])
            .args(["--max-singles", &max_singles.to_string()])
            .args(["--tag", tag])
            .env("GLOG_minloglevel", "1"),
        &log,
        Some(&out),
        Duration::from_secs_f64(5.0 * secs + 240.0),
        "mooncake_row.py run",
    )?;
    let mut text = String::new();
    std::fs::File::open(&out)
        .and_then(|mut f| f.read_to_string(&mut text))
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let mut doc: std::collections::HashMap<String, PyPhase> = serde_json::from_str(text.trim())
        .map_err(|e| format!("mooncake_row.py printed {} bytes: {e}", text.len()))?;
    let mut take = |k: &str| -> Result<Run, String> {
        doc.remove(k)
            .map(Run::from)
            .ok_or_else(|| format!("mooncake_row.py: no phase {k}"))
    };
    Ok([
        take("put_batch")?,
        take("put_single")?,
        take("get_batch")?,
        take("get_single")?,
        take("exists_batch")?,
    ])
}

fn exists_batch(h: &CHandler, keys: &[CString]) -> Result<(), String> {
    let kp = key_ptrs(keys);
    let mut found = vec![false; keys.len()];
    // SAFETY: arrays of keys.len() entries; the handler is open.
    check(
        unsafe {
            maru::ffi::maru_exists_batch(
                h.as_ptr(),
                kp.as_ptr(),
                kp.len(),
                kp[0],
                found.as_mut_ptr(),
            )
        },
        "maru_exists_batch",
    )?;
    every_set(&found, |n, of| {
        format!("maru_exists_batch missed {n} of {of} stored keys")
    })
}

/// One turn of Maru `backend` on a fresh stack: the same five phases as Mooncake's.
pub(super) fn maru_turn(
    s: &Scratch,
    backend: &'static str,
    chunk: usize,
    clients: usize,
    secs: f64,
    rotate: usize,
) -> Result<Turn, String> {
    let st = stack(
        s,
        backend == "remote_cxl",
        &REGION.to_string(),
        &chunk.to_string(),
    )?;
    let handlers: Vec<Arc<CHandler>> = (0..clients)
        .map(|i| {
            CHandler::open(&handler_config(
                &st.server,
                backend,
                &format!("bench-mc-{backend}-{i}"),
                s,
            ))
            .map(Arc::new)
        })
        .collect::<Result<_, _>>()?;
    // Space as maru_io: two regions per engine to spare, 3/4 of a client's share in
    // batches.
    let usable = (s.pool_size as usize)
        .saturating_sub(REGION * (2 * clients + 2))
        .max(chunk * BATCH * 2 * clients);
    let per_client = usable / chunk / clients;
    let max_batches = (per_client * 3 / 4 / BATCH).max(1);
    let max_singles = per_client
        .saturating_sub(max_batches * BATCH + BATCH)
        .max(1);
    let tag = move |c: usize, kind: &str, i: usize| {
        CString::new(format!("mc-{backend}-{chunk}-{kind}-{c}-{i}")).unwrap_or_default()
    };
    let srcs: Vec<_> = (0..clients)
        .map(|c| Arc::new(Mutex::new(Rotor::new(rotate, chunk, 7 + c as u64))))
        .collect();
    let dsts: Vec<_> = (0..clients)
        .map(|_| Arc::new(Mutex::new(Rotor::new(rotate, chunk, 3))))
        .collect();
    // Warm-up, not measured (as Mooncake's): a region's worth of batches per client
    // stored and removed, then the handlers' background prefaulting settled.
    let cycles = REGION / (chunk * BATCH) + 2;
    for (c, h) in handlers.iter().enumerate() {
        let mut src = srcs[c].lock().map_err(|_| "poisoned")?;
        for i in 0..cycles {
            let keys: Vec<CString> = (0..BATCH).map(|j| tag(c, "w", i * BATCH + j)).collect();
            let ptrs: Vec<*const u8> = (0..BATCH).map(|_| src.next_ptr() as *const u8).collect();
            h.store_batch(&keys, &ptrs, chunk)?;
            if i == 0 {
                let mut dst = dsts[c].lock().map_err(|_| "poisoned")?;
                let bufs: Vec<*mut u8> = (0..BATCH).map(|_| dst.next_ptr()).collect();
                h.load_batch(&keys, &bufs, chunk)?;
            }
            h.remove_batch(&keys)?;
        }
    }
    for h in &handlers {
        h.settle_prefault()?;
    }
    let bound = |max_ops| Bound { secs, max_ops };
    let stored = Arc::new(Mutex::new(vec![0usize; clients]));
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let (h, src, stored) = (handlers[c].clone(), srcs[c].clone(), stored.clone());
            move |i: usize| -> Result<u64, String> {
                let keys: Vec<CString> = (0..BATCH).map(|j| tag(c, "b", i * BATCH + j)).collect();
                let ptrs: Vec<*const u8> = {
                    let mut r = src.lock().map_err(|_| "poisoned")?;
                    (0..BATCH).map(|_| r.next_ptr() as *const u8).collect()
                };
                h.store_batch(&keys, &ptrs, chunk)?;
                if let Ok(mut n) = stored.lock() {
                    n[c] = i + 1;
                }
                Ok((BATCH * chunk) as u64)
            }
        })
        .collect();
    let put_batch = run_clients_raw(ops, bound(max_batches))?;
    let stored: Vec<usize> = stored.lock().map_err(|_| "poisoned")?.clone();
    let client = |c: usize| ClientOps {
        h: handlers[c].clone(),
        c,
        src: srcs[c].clone(),
        dst: dsts[c].clone(),
        tag,
        chunk,
    };
    let ops: Vec<_> = (0..clients)
        .map(|c| client(c).store_single(chunk))
        .collect();
    let put_single = run_clients_raw(ops, bound(max_singles))?;
    let [get_batch, get_single] = load_phases(client, &stored, bound(usize::MAX))?;
    // The keys of each batch made once, as Mooncake's side does: the figure times the call.
    let ops: Vec<_> = (0..clients)
        .map(|c| {
            let h = handlers[c].clone();
            let batches: Vec<Vec<CString>> = (0..stored[c].max(1))
                .map(|b| (0..BATCH).map(|j| tag(c, "b", b * BATCH + j)).collect())
                .collect();
            move |i: usize| -> Result<u64, String> {
                exists_batch(&h, &batches[i % batches.len()])?;
                Ok(0)
            }
        })
        .collect();
    let exists = run_clients_raw(ops, bound(usize::MAX))?;
    drop(handlers);
    drop(st);
    Ok([put_batch, put_single, get_batch, get_single, exists])
}
