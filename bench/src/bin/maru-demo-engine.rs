//! maru-demo-engine: one "inference engine" of the one-host demo. It runs a prompt of
//! N chunks: for each chunk it looks the key up in Maru; a hit is loaded (and its
//! checksum checked against the KV the engine would compute), a miss is computed (a
//! deterministic, CPU-bound stand-in for prefill) and stored. It prints one JSON line
//! with what happened and how long computing and loading took.

use clap::Parser;
use maru::worker::Handler;
use sha2::{Digest, Sha256};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    name = "maru-demo-engine",
    about = "A demo engine: compute-or-load the KV chunks of a prompt through Maru"
)]
struct Args {
    /// Handler configuration (JSON).
    #[arg(long)]
    config: String,
    /// Prompt text; its chunks' keys are prefix-chained hashes, so two engines with
    /// the same prompt prefix find each other's chunks.
    #[arg(long)]
    prompt: String,
    /// Chunks in the prompt.
    #[arg(long, default_value_t = 64)]
    chunks: usize,
    /// Bytes of KV per chunk (at most the pool's chunk size).
    #[arg(long, default_value_t = 1 << 20)]
    chunk_bytes: usize,
    /// Rounds of hashing per chunk standing in for the compute of a prefill.
    #[arg(long, default_value_t = 6)]
    compute_rounds: usize,
}

/// Prefix-chained chunk keys: key(i) = H(key(i-1) ‖ chunk i's tokens).
fn chunk_keys(prompt: &str, n: usize) -> Vec<String> {
    let mut prev = [0u8; 32];
    (0..n)
        .map(|i| {
            let mut h = Sha256::new();
            h.update(prev);
            h.update(format!("{prompt}#{i}").as_bytes());
            prev = h.finalize().into();
            maru::auth::to_hex(&prev[..16])
        })
        .collect()
}

/// The KV bytes of a chunk: deterministic in its key, costly to produce.
fn compute_kv(key: &str, len: usize, rounds: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut seed: [u8; 32] = Sha256::digest(key.as_bytes()).into();
    for _ in 0..rounds {
        for block in out.chunks_mut(32) {
            seed = Sha256::digest(seed).into();
            block.copy_from_slice(&seed[..block.len()]);
        }
    }
    out
}

fn main() {
    let a = Args::parse();
    let h = match Handler::open(&a.config) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: cannot open the handler: {e}");
            std::process::exit(2);
        }
    };
    let keys = chunk_keys(&a.prompt, a.chunks);
    let route = keys[0].clone();
    let (mut hits, mut misses, mut stored, mut mismatches) = (0u64, 0u64, 0u64, 0u64);
    let (mut load_s, mut compute_s, mut bytes_loaded) = (0f64, 0f64, 0u64);
    let mut verify_s = 0f64;
    for batch in keys.chunks(16) {
        let t = Instant::now();
        let got = match h.load_batch(batch, Some(&route)) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("error: load: {e}");
                std::process::exit(1);
            }
        };
        load_s += t.elapsed().as_secs_f64();
        let mut to_store = Vec::new();
        for (k, g) in batch.iter().zip(got) {
            match g {
                Some(bytes) => {
                    hits += 1;
                    bytes_loaded += bytes.len() as u64;
                    // Check the bytes against what this engine would have computed.
                    let t = Instant::now();
                    if bytes != compute_kv(k, a.chunk_bytes, a.compute_rounds) {
                        mismatches += 1;
                    }
                    verify_s += t.elapsed().as_secs_f64();
                }
                None => {
                    misses += 1;
                    let t = Instant::now();
                    let kv = compute_kv(k, a.chunk_bytes, a.compute_rounds);
                    compute_s += t.elapsed().as_secs_f64();
                    to_store.push((k.clone(), kv));
                }
            }
        }
        if !to_store.is_empty() {
            let items: Vec<(&str, &[u8])> = to_store
                .iter()
                .map(|(k, d)| (k.as_str(), d.as_slice()))
                .collect();
            match h.store_batch(&items, Some(&route)) {
                Ok(ok) => stored += ok.iter().filter(|&&x| x).count() as u64,
                Err(e) => eprintln!("warning: store: {e}"),
            }
        }
    }
    let _ = h.close();
    let per_chunk_compute = if misses > 0 {
        compute_s / misses as f64
    } else {
        verify_s / hits.max(1) as f64
    };
    println!(
        "{}",
        serde_json::json!({
            "chunks": a.chunks, "hits": hits, "misses": misses, "stored": stored,
            "mismatches": mismatches, "bytes_loaded": bytes_loaded,
            "load_s": load_s, "compute_s": compute_s,
            "load_gbs": if load_s > 0.0 { bytes_loaded as f64 / load_s / 1e9 } else { 0.0 },
            "prefix_compute_s": per_chunk_compute * a.chunks as f64,
        })
    );
    if mismatches > 0 {
        std::process::exit(1);
    }
}
