//! Eviction orders from the caching literature, each as one global cache of a fixed
//! number of chunks (no per-engine split), replayed as a prefix cache: a request's
//! hits are the leading run of its chunks found (each read), and the chunks after the
//! first miss that are not cached are stored; a cached chunk after the miss is left
//! as it is.
//!
//! - LRU; Belady's MIN (the chunk used again furthest ahead goes: the offline optimum
//!   for chunk hits, an upper bound here since a hit counts only in the leading run);
//! - ARC (Megiddo and Modha, FAST'03), 2Q (Johnson and Shasha, VLDB'94, the full
//!   version: Kin 25 %, Kout 50 %), S3-FIFO (Yang et al., SOSP'23: small queue 10 %,
//!   ghost as large as the main queue, counts up to 3);
//! - the rules of maru-server's `--victim-order reuse` (libmaru/src/meta/evict_rank.rs)
//!   one by one, without the tail-first rule, to see what each adds.

use super::trace::Trace;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

/// A cache replayed by [`replay`].
pub trait Policy {
    fn contains(&self, c: u32) -> bool;
    /// A cached chunk read (in a request's leading run).
    fn read(&mut self, c: u32);
    /// A chunk not cached, stored; `end`: the last chunk of its request.
    fn store(&mut self, c: u32, end: bool);
}

/// Hits over chunk accesses of `t` through `p`.
pub fn replay(t: &Trace, p: &mut impl Policy) -> f64 {
    let mut hits = 0usize;
    for r in &t.requests {
        let lead = r.iter().take_while(|c| p.contains(**c)).count();
        hits += lead;
        for (i, &c) in r.iter().enumerate() {
            if i < lead {
                p.read(c);
            } else if !p.contains(c) {
                p.store(c, i + 1 == r.len());
            }
        }
    }
    hits as f64 / t.accesses().max(1) as f64
}

/// A queue of chunks in order of insertion, with removal of any chunk (lazy: a
/// chunk's place is its sequence number).
#[derive(Default)]
struct Queue {
    order: VecDeque<(u64, u32)>,
    at: HashMap<u32, u64>,
    seq: u64,
}

impl Queue {
    fn len(&self) -> usize {
        self.at.len()
    }
    fn has(&self, c: u32) -> bool {
        self.at.contains_key(&c)
    }
    fn push(&mut self, c: u32) {
        self.seq += 1;
        self.at.insert(c, self.seq);
        self.order.push_back((self.seq, c));
    }
    fn remove(&mut self, c: u32) -> bool {
        self.at.remove(&c).is_some()
    }
    fn pop(&mut self) -> Option<u32> {
        while let Some((s, c)) = self.order.pop_front() {
            if self.at.get(&c) == Some(&s) {
                self.at.remove(&c);
                return Some(c);
            }
        }
        None
    }
}

/// Least recently used first.
pub struct Lru {
    cap: usize,
    q: Queue,
}

impl Lru {
    pub fn new(cap: usize) -> Lru {
        Lru {
            cap,
            q: Queue::default(),
        }
    }
}

impl Policy for Lru {
    fn contains(&self, c: u32) -> bool {
        self.q.has(c)
    }
    fn read(&mut self, c: u32) {
        self.q.push(c);
    }
    fn store(&mut self, c: u32, _: bool) {
        self.q.push(c);
        while self.q.len() > self.cap {
            self.q.pop();
        }
    }
}

/// Belady's MIN over the same accesses.
pub fn belady(t: &Trace, cap: usize) -> f64 {
    let stream: Vec<u32> = t.requests.iter().flatten().copied().collect();
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
    let (mut pos, mut hits) = (0usize, 0usize);
    for r in &t.requests {
        hits += r.iter().take_while(|c| when.contains_key(c)).count();
        for &c in r {
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
            while order.len() > cap {
                if let Some((_, v)) = order.pop_last() {
                    when.remove(&v);
                }
            }
        }
    }
    hits as f64 / t.accesses().max(1) as f64
}

/// ARC: T1 (seen once lately) and T2 (seen twice or more), LRU each, with ghosts B1
/// and B2 steering the target size `p` of T1.
pub struct Arc {
    cap: usize,
    p: usize,
    t1: Queue,
    t2: Queue,
    b1: Queue,
    b2: Queue,
}

impl Arc {
    pub fn new(cap: usize) -> Arc {
        Arc {
            cap,
            p: 0,
            t1: Queue::default(),
            t2: Queue::default(),
            b1: Queue::default(),
            b2: Queue::default(),
        }
    }

    fn replace(&mut self, in_b2: bool) {
        let t1 = self.t1.len();
        if t1 > 0 && (t1 > self.p || (in_b2 && t1 == self.p)) {
            if let Some(c) = self.t1.pop() {
                self.b1.push(c);
            }
        } else if let Some(c) = self.t2.pop() {
            self.b2.push(c);
        } else if let Some(c) = self.t1.pop() {
            self.b1.push(c);
        }
    }
}

impl Policy for Arc {
    fn contains(&self, c: u32) -> bool {
        self.t1.has(c) || self.t2.has(c)
    }
    fn read(&mut self, c: u32) {
        self.t1.remove(c);
        self.t2.push(c);
    }
    fn store(&mut self, c: u32, _: bool) {
        let (b1, b2) = (self.b1.len().max(1), self.b2.len().max(1));
        if self.b1.remove(c) {
            self.p = (self.p + (b2 / b1).max(1)).min(self.cap);
            self.replace(false);
            self.t2.push(c);
            return;
        }
        if self.b2.remove(c) {
            self.p = self.p.saturating_sub((b1 / b2).max(1));
            self.replace(true);
            self.t2.push(c);
            return;
        }
        let l1 = self.t1.len() + self.b1.len();
        let all = l1 + self.t2.len() + self.b2.len();
        if l1 >= self.cap {
            if self.t1.len() < self.cap {
                self.b1.pop();
                self.replace(false);
            } else {
                self.t1.pop();
            }
        } else if all >= self.cap {
            if all >= 2 * self.cap {
                self.b2.pop();
            }
            self.replace(false);
        }
        self.t1.push(c);
    }
}

/// 2Q: new chunks in a FIFO (A1in); those it drops are remembered (A1out), and one
/// stored again while remembered goes to an LRU (Am), as does one read.
pub struct TwoQ {
    cap: usize,
    kin: usize,
    kout: usize,
    a1in: Queue,
    a1out: Queue,
    am: Queue,
}

impl TwoQ {
    pub fn new(cap: usize) -> TwoQ {
        TwoQ {
            cap,
            kin: (cap / 4).max(1),
            kout: (cap / 2).max(1),
            a1in: Queue::default(),
            a1out: Queue::default(),
            am: Queue::default(),
        }
    }
}

impl Policy for TwoQ {
    fn contains(&self, c: u32) -> bool {
        self.a1in.has(c) || self.am.has(c)
    }
    fn read(&mut self, c: u32) {
        // A read in A1in is a correlated reference (2Q leaves it there).
        if self.am.has(c) {
            self.am.push(c);
        }
    }
    fn store(&mut self, c: u32, _: bool) {
        if self.a1out.remove(c) {
            self.am.push(c);
        } else {
            self.a1in.push(c);
        }
        while self.a1in.len() + self.am.len() > self.cap {
            if self.a1in.len() > self.kin || self.am.len() == 0 {
                if let Some(v) = self.a1in.pop() {
                    self.a1out.push(v);
                    if self.a1out.len() > self.kout {
                        self.a1out.pop();
                    }
                }
            } else {
                self.am.pop();
            }
        }
    }
}

/// S3-FIFO: a small FIFO for new chunks (10 %), a main FIFO with reinsertion, and a
/// ghost FIFO of chunks dropped from the small one; counts of reads up to 3.
pub struct S3Fifo {
    cap: usize,
    small_cap: usize,
    small: Queue,
    main: Queue,
    ghost: Queue,
    freq: HashMap<u32, u8>,
}

impl S3Fifo {
    pub fn new(cap: usize) -> S3Fifo {
        S3Fifo {
            cap,
            small_cap: (cap / 10).max(1),
            small: Queue::default(),
            main: Queue::default(),
            ghost: Queue::default(),
            freq: HashMap::new(),
        }
    }

    fn evict_main(&mut self) {
        while let Some(c) = self.main.pop() {
            match self.freq.get(&c).copied().unwrap_or(0) {
                0 => {
                    self.freq.remove(&c);
                    return;
                }
                f => {
                    self.freq.insert(c, f - 1);
                    self.main.push(c);
                }
            }
        }
    }

    fn evict_small(&mut self) {
        while let Some(c) = self.small.pop() {
            if self.freq.get(&c).copied().unwrap_or(0) > 0 {
                self.freq.insert(c, 0);
                self.main.push(c);
                if self.main.len() > self.cap - self.small_cap {
                    self.evict_main();
                }
            } else {
                self.freq.remove(&c);
                self.ghost.push(c);
                if self.ghost.len() > self.cap - self.small_cap {
                    self.ghost.pop();
                }
                return;
            }
        }
    }
}

impl Policy for S3Fifo {
    fn contains(&self, c: u32) -> bool {
        self.freq.contains_key(&c)
    }
    fn read(&mut self, c: u32) {
        if let Some(f) = self.freq.get_mut(&c) {
            *f = (*f + 1).min(3);
        }
    }
    fn store(&mut self, c: u32, _: bool) {
        while self.small.len() + self.main.len() >= self.cap {
            if self.small.len() >= self.small_cap || self.main.len() == 0 {
                self.evict_small();
            } else {
                self.evict_main();
            }
        }
        self.freq.insert(c, 0);
        if self.ghost.remove(c) {
            self.main.push(c);
        } else {
            self.small.push(c);
        }
    }
}

/// The rules of `--victim-order reuse` in one global cache: the lowest rank goes,
/// a rank being the last use stamp plus `credit` × (cached chunks / 2) per read;
/// with `ghosts`, reads outlive an eviction (as many names as the capacity) and a
/// chunk stored again starts from them plus one; with `ends`, a request's last
/// chunk stored and never read goes before every other.
pub struct Reuse {
    cap: usize,
    credit: bool,
    ghosts: bool,
    ends: bool,
    stamp: u64,
    /// chunk → (rank, reads).
    state: HashMap<u32, (u64, u32)>,
    order: BTreeSet<(u64, u32)>,
    ghost: Queue,
    ghost_reads: HashMap<u32, u32>,
}

const SPAN: u64 = 1 << 48;

impl Reuse {
    pub fn new(cap: usize, credit: bool, ghosts: bool, ends: bool) -> Reuse {
        Reuse {
            cap,
            credit,
            ghosts,
            ends,
            stamp: 0,
            state: HashMap::new(),
            order: BTreeSet::new(),
            ghost: Queue::default(),
            ghost_reads: HashMap::new(),
        }
    }

    fn set(&mut self, c: u32, reads: u32, end: bool) {
        self.stamp += 1;
        let per_read = if self.credit {
            self.state.len() as u64 / 2
        } else {
            0
        };
        let rank = if end && self.ends {
            self.stamp
        } else {
            SPAN + self.stamp + per_read * u64::from(reads)
        };
        if let Some((old, _)) = self.state.insert(c, (rank, reads)) {
            self.order.remove(&(old, c));
        }
        self.order.insert((rank, c));
    }
}

impl Policy for Reuse {
    fn contains(&self, c: u32) -> bool {
        self.state.contains_key(&c)
    }
    fn read(&mut self, c: u32) {
        let reads = self.state.get(&c).map_or(0, |s| s.1);
        self.set(c, reads.saturating_add(1), false);
    }
    fn store(&mut self, c: u32, end: bool) {
        let reads = match self.ghosts && self.ghost.remove(c) {
            true => self.ghost_reads.remove(&c).map_or(0, |n| n + 1),
            false => 0,
        };
        self.set(c, reads, end && reads == 0);
        while self.state.len() > self.cap {
            let Some((_, v)) = self.order.pop_first() else {
                break;
            };
            if let Some((_, n)) = self.state.remove(&v) {
                if self.ghosts {
                    self.ghost.push(v);
                    self.ghost_reads.insert(v, n);
                    while self.ghost.len() > self.cap {
                        if let Some(g) = self.ghost.pop() {
                            self.ghost_reads.remove(&g);
                        }
                    }
                }
            }
        }
    }
}

/// Chunks of `t` used more than once, and the hits their reuses bound.
pub fn reuse_bound(t: &Trace) -> f64 {
    let mut seen = HashSet::new();
    let again = t
        .requests
        .iter()
        .flatten()
        .filter(|c| !seen.insert(**c))
        .count();
    again as f64 / t.accesses().max(1) as f64
}
