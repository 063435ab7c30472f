//! The traces of the hit-rate bench and the balancer that routes them to engines.
//!
//! A trace is a list of requests, each its prompt's chunk ids in order (a chunk id
//! names a prefix: two requests with the same id at the same place share every
//! chunk before it too). Two sources:
//!
//! - [`synthesize`]: the bench's own multi-turn chat trace (Zipf conversations over a
//!   few system prompts), always run;
//! - [`load_jsonl`]: a trace in the JSON-lines format of Mooncake's FAST'25 release
//!   (`FAST25-release/traces/*.jsonl` of github.com/kvcache-ai/Mooncake), one request a
//!   line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//!   "hash_ids": [ids of its 512-token blocks]}`.

use maru_testkit::Rng;
use serde::Deserialize;
use std::collections::HashMap;

pub struct Trace {
    /// What the tables call it.
    pub name: String,
    /// Each request's chunk ids (dense, from 0), in prompt order.
    pub requests: Vec<Vec<u32>>,
    /// Distinct chunk ids.
    pub distinct: usize,
    /// Whether each request's last chunk is a partial one (its tokens not a multiple
    /// of the block size); empty: none is.
    pub partial_last: Vec<bool>,
    /// Accesses to partial last chunks left out of `requests` (each a miss).
    pub unstored: usize,
}

impl Trace {
    /// Chunk accesses in all.
    pub fn accesses(&self) -> usize {
        self.requests.iter().map(Vec::len).sum::<usize>() + self.unstored
    }

    /// The trace as a connector that stores whole chunks only sees it (Maru's vLLM
    /// connector: a partial last chunk has no key and is always computed): each
    /// partial last chunk left out, its access counted as a miss.
    pub fn whole_chunks_only(&self) -> Trace {
        let mut unstored = self.unstored;
        let requests = self
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let cut = self.partial_last.get(i).copied().unwrap_or(false) && !r.is_empty();
                unstored += usize::from(cut);
                r[..r.len() - usize::from(cut)].to_vec()
            })
            .collect();
        Trace {
            name: format!("{}, partial last blocks not stored", self.name),
            requests,
            distinct: self.distinct,
            partial_last: Vec::new(),
            unstored,
        }
    }
}

/// Dense ids for the names of a trace, in order of first appearance.
#[derive(Default)]
struct Ids<K>(HashMap<K, u32>);

impl<K: std::hash::Hash + Eq> Ids<K> {
    fn id(&mut self, k: K) -> u32 {
        let n = self.0.len() as u32;
        *self.0.entry(k).or_insert(n)
    }
}

pub const SYSTEMS: usize = 8;
const SYSTEM_CHUNKS: usize = 4;
const MAX_TURNS: usize = 12;
pub const ZIPF: f64 = 0.9;

/// `SYSTEMS` system prompts shared by many conversations; conversations whose
/// popularity follows a Zipf law; each request is a conversation's next turn, its
/// prompt the system prompt's chunks then the whole history so far (two chunks more
/// per turn). A conversation that reached `MAX_TURNS` starts over (new chunks).
pub fn synthesize(conversations: usize, requests: usize) -> Trace {
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
    // (system prompt, conversation, epoch, chunk); conversation usize::MAX: the system.
    let mut ids: Ids<(usize, usize, usize, usize)> = Ids::default();
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
            .map(|i| ids.id((s, usize::MAX, 0, i)))
            .collect();
        chunks.extend((0..2 * turn[c]).map(|j| ids.id((s, c, epoch[c], j))));
        out.push(chunks);
    }
    Trace {
        name: format!(
            "synthesized chat ({requests} requests, {conversations} conversations Zipf {ZIPF}, \
             {SYSTEMS} system prompts)"
        ),
        requests: out,
        distinct: ids.0.len(),
        partial_last: Vec::new(),
        unstored: 0,
    }
}

/// Tokens per block of Mooncake's traces.
pub const BLOCK_TOKENS: u64 = 512;

#[derive(Deserialize)]
struct Line {
    hash_ids: Vec<u64>,
    #[serde(default)]
    input_length: u64,
}

/// A trace of Mooncake's JSON-lines format; `limit` keeps its first requests only.
pub fn load_jsonl(path: &std::path::Path, limit: Option<usize>) -> Result<Trace, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "hit-rate trace {}: {e} (the Mooncake traces are in FAST25-release/traces/ of \
             github.com/kvcache-ai/Mooncake; see docs/benchmarks.md)",
            path.display()
        )
    })?;
    let mut ids: Ids<u64> = Ids::default();
    let mut requests = Vec::new();
    let mut partial_last = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|l| requests.len() >= l) {
            break;
        }
        let l: Line = serde_json::from_str(line).map_err(|e| {
            format!(
                "hit-rate trace {} line {}: {e} (want {{\"hash_ids\": [...], ...}} per line)",
                path.display(),
                n + 1
            )
        })?;
        partial_last.push(l.input_length % BLOCK_TOKENS != 0);
        requests.push(l.hash_ids.into_iter().map(|h| ids.id(h)).collect());
    }
    if requests.is_empty() {
        return Err(format!("hit-rate trace {}: no requests", path.display()));
    }
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    Ok(Trace {
        name: format!("{name} ({} requests)", requests.len()),
        requests,
        distinct: ids.0.len(),
        partial_last,
        unstored: 0,
    })
}

/// The engine of each request, as a prefix-aware balancer sends it: to the engine it
/// sent the deepest chunk of the request's longest remembered prefix to, when that
/// prefix is at least half the request; else to the engine with the fewest requests
/// so far (the first on a tie). One engine: all to it.
pub fn route(t: &Trace, engines: usize) -> Vec<usize> {
    let mut last: HashMap<u32, usize> = HashMap::new();
    let mut load = vec![0usize; engines.max(1)];
    t.requests
        .iter()
        .map(|r| {
            let mut depth = 0;
            let mut owner = None;
            for c in r {
                match last.get(c) {
                    Some(&e) => {
                        depth += 1;
                        owner = Some(e);
                    }
                    None => break,
                }
            }
            let least = (0..load.len()).min_by_key(|&e| load[e]).unwrap_or(0);
            let e = match owner {
                Some(e) if 2 * depth >= r.len() => e,
                _ => least,
            };
            load[e] += 1;
            for &c in r {
                last.insert(c, e);
            }
            e
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_balancer_keeps_a_conversation_on_its_engine_and_spreads_new_ones() {
        let t = Trace {
            name: "t".into(),
            // Two conversations sharing chunk 0; their next turns; a new one.
            requests: vec![
                vec![0, 1, 2],
                vec![0, 3, 4],
                vec![0, 1, 2, 5],
                vec![0, 3, 4, 6, 7],
                vec![0, 8, 9],
            ],
            distinct: 10,
            partial_last: Vec::new(),
            unstored: 0,
        };
        assert_eq!(route(&t, 2), [0, 1, 0, 1, 0]);
        assert_eq!(route(&t, 1), [0; 5]);
    }

    #[test]
    fn a_mooncake_trace_line_gives_dense_ids_and_a_bad_line_says_where() {
        let dir = std::env::temp_dir().join(format!("maru-hitrate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 0, \"input_length\": 900, \"output_length\": 3, \"hash_ids\": [7, 9]}\n\
             {\"timestamp\": 5, \"input_length\": 1500, \"output_length\": 3, \"hash_ids\": [7, 9, 11]}\n",
        )
        .unwrap();
        let t = load_jsonl(&p, None).unwrap();
        assert_eq!(t.requests, [vec![0, 1], vec![0, 1, 2]]);
        assert_eq!((t.distinct, t.accesses()), (3, 5));
        // 900 tokens: the second block of the first request is partial; 1536 = 3 × 512.
        std::fs::write(
            &p,
            "{\"input_length\": 900, \"hash_ids\": [7, 9]}\n{\"input_length\": 1536, \"hash_ids\": [7, 9, 11]}\n",
        )
        .unwrap();
        let w = load_jsonl(&p, None).unwrap().whole_chunks_only();
        assert_eq!(w.requests, [vec![0], vec![0, 1, 2]]);
        assert_eq!((w.accesses(), w.unstored), (5, 1));
        assert_eq!(load_jsonl(&p, Some(1)).unwrap().requests.len(), 1);
        std::fs::write(&p, "{\"hash_ids\": [1]}\nnot json\n").unwrap();
        let e = load_jsonl(&p, None).err().unwrap();
        assert!(e.contains("line 2"), "{e}");
        let e = load_jsonl(&dir.join("absent.jsonl"), None).err().unwrap();
        assert!(e.contains("kvcache-ai/Mooncake"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
