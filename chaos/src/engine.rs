//! One engine process of the chaos run: stores chunks under its own keys and loads
//! its own and the other engine's, checking every byte that comes back.
//!
//! A chunk's bytes are a function of its key ([`chunk_of`]), so any process can check
//! any load without shared state: a load returns either nothing (a miss) or exactly
//! `chunk_of(key)`. A mismatch is appended to the mismatch file at once (it survives a
//! kill -9); the counters are rewritten (tmp + rename) after every round.

use maru::worker::Handler;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Chunk (page) size maru-server is started with in the chaos run.
pub const CHUNK: usize = 64 * 1024;

pub struct EngineArgs {
    pub name: String,
    pub peer: String,
    pub config: String,
    pub keys: u64,
    pub seed: u64,
    pub stop_file: PathBuf,
    pub stats_file: PathBuf,
    pub mismatch_file: PathBuf,
    pub max_seconds: u64,
}

/// A small deterministic generator (xorshift64*), seeded per engine incarnation.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo).max(1)
    }
}

/// The bytes stored under `key`: 1 KiB to a full chunk, from the key's SHA-256.
pub fn chunk_of(key: &str) -> Vec<u8> {
    let d = Sha256::digest(key.as_bytes());
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&d[..8]);
    let mut rng = Rng::new(u64::from_le_bytes(seed));
    let len = 1024 + (rng.next() as usize) % (CHUNK - 1024 + 1);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        out.extend_from_slice(&rng.next().to_le_bytes());
    }
    out.truncate(len);
    out
}

#[derive(Default)]
struct Counts {
    opens: u64,
    open_errors: u64,
    stored: u64,
    store_skipped: u64,
    store_errors: u64,
    loads_verified: u64,
    load_misses: u64,
    load_errors: u64,
    mismatches: u64,
    closed: bool,
}

impl Counts {
    fn save(&self, path: &Path) {
        let v = serde_json::json!({
            "opens": self.opens,
            "open_errors": self.open_errors,
            "stored": self.stored,
            "store_skipped": self.store_skipped,
            "store_errors": self.store_errors,
            "loads_verified": self.loads_verified,
            "load_misses": self.load_misses,
            "load_errors": self.load_errors,
            "mismatches": self.mismatches,
            "closed": self.closed,
        });
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, v.to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

fn record_mismatch(path: &Path, line: &str) {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path);
    match f {
        Ok(mut f) => {
            let _ = writeln!(f, "{line}");
        }
        Err(e) => eprintln!("chaos engine: cannot record a mismatch ({line}): {e}"),
    }
}

/// Runs until the stop file appears (or `max_seconds` pass), then closes the handler.
/// Returns the process exit code: 0, or 1 when a load returned wrong bytes.
pub fn run(a: &EngineArgs) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(a.max_seconds);
    let mut c = Counts::default();
    let mut rng = Rng::new(a.seed);
    let stop = || a.stop_file.exists() || Instant::now() > deadline;
    let mut handler = None;
    while !stop() {
        let h = match &handler {
            Some(h) => h,
            None => match Handler::open(&a.config) {
                Ok(h) => {
                    c.opens += 1;
                    handler.insert(h)
                }
                Err(e) => {
                    // maru-server may be down right now: try again shortly.
                    c.open_errors += 1;
                    if c.open_errors % 50 == 1 {
                        eprintln!("chaos engine {}: open: {e}", a.name);
                    }
                    c.save(&a.stats_file);
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            },
        };
        round(h, a, &mut rng, &mut c);
        c.save(&a.stats_file);
    }
    if let Some(h) = handler {
        if let Err(e) = h.close() {
            eprintln!("chaos engine {}: close: {e}", a.name);
        }
    }
    c.closed = true;
    c.save(&a.stats_file);
    if c.mismatches > 0 {
        1
    } else {
        0
    }
}

/// One round: store a batch of own keys, then load a batch of own and peer keys.
fn round(h: &Handler, a: &EngineArgs, rng: &mut Rng, c: &mut Counts) {
    let keys: Vec<String> = (0..8)
        .map(|_| format!("{}-{}", a.name, rng.range(0, a.keys)))
        .collect();
    let data: Vec<Vec<u8>> = keys.iter().map(|k| chunk_of(k)).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .zip(&data)
        .map(|(k, d)| (k.as_str(), d.as_slice()))
        .collect();
    match h.store_batch(&items, Some("chaos")) {
        Ok(ok) => {
            let n = ok.iter().filter(|&&x| x).count() as u64;
            c.stored += n;
            c.store_skipped += ok.len() as u64 - n;
        }
        Err(_) => c.store_errors += 1,
    }
    let keys: Vec<String> = (0..8)
        .map(|_| {
            let who = if rng.next() % 2 == 0 {
                &a.name
            } else {
                &a.peer
            };
            format!("{who}-{}", rng.range(0, a.keys))
        })
        .collect();
    match h.load_batch(&keys, Some("chaos")) {
        Ok(got) => {
            for (k, g) in keys.iter().zip(got) {
                match g {
                    None => c.load_misses += 1,
                    Some(bytes) => {
                        let want = chunk_of(k);
                        if bytes == want {
                            c.loads_verified += 1;
                        } else {
                            c.mismatches += 1;
                            let differ = bytes.iter().zip(&want).filter(|(x, y)| x != y).count();
                            record_mismatch(
                                &a.mismatch_file,
                                &format!(
                                    "{}: key {k}: got {} bytes, stored {} bytes, {differ} of the common bytes differ",
                                    a.name,
                                    bytes.len(),
                                    want.len()
                                ),
                            );
                        }
                    }
                }
            }
        }
        Err(_) => c.load_errors += 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_is_a_function_of_its_key() {
        assert_eq!(chunk_of("a-1"), chunk_of("a-1"));
        assert_ne!(chunk_of("a-1"), chunk_of("a-2"));
        for k in ["x", "a-0", "b-199"] {
            let n = chunk_of(k).len();
            assert!((1024..=CHUNK).contains(&n), "{k}: {n}");
        }
    }
}
