//! PoolRouter: a request stays in one pool, picked by rendezvous hashing of its first
//! chunk key: adding or losing a pool moves only the prefixes that pool wins.

use sha2::{Digest, Sha256};

/// The pools (one maru-server URL each) and which of them are up.
#[derive(Debug, Clone)]
pub struct PoolRouter {
    urls: Vec<String>,
    up: Vec<bool>,
}

/// Splits a comma-separated `server_url` into pool URLs; blank entries are an error.
pub fn parse_server_urls(s: &str) -> Result<Vec<String>, String> {
    let urls: Vec<String> = s.split(',').map(|u| u.trim().to_string()).collect();
    if urls.iter().any(|u| u.is_empty()) {
        return Err(format!(
            "server_url {s:?} has an empty entry: give host:port[,host:port...]"
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for u in &urls {
        if !seen.insert(u) {
            return Err(format!("server_url lists {u} twice"));
        }
    }
    Ok(urls)
}

fn weight(url: &str, key: &str) -> u64 {
    let mut h = Sha256::new();
    h.update((url.len() as u64).to_le_bytes());
    h.update(url.as_bytes());
    h.update(key.as_bytes());
    u64::from_le_bytes(h.finalize()[..8].try_into().unwrap_or([0; 8]))
}

impl PoolRouter {
    pub fn new(urls: Vec<String>) -> PoolRouter {
        let up = vec![true; urls.len()];
        PoolRouter { urls, up }
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The pool of a request whose first chunk key is `route_key`, whether or not it
    /// is up (a request never moves to another pool: its prefixes would be split).
    pub fn pick(&self, route_key: &str) -> usize {
        (0..self.urls.len())
            .max_by_key(|&i| weight(&self.urls[i], route_key))
            .unwrap_or(0)
    }

    /// Records a pool's reachability; returns true if it changed (for logging with the
    /// pool's own URL).
    pub fn set_up(&mut self, pool: usize, up: bool) -> bool {
        match self.up.get_mut(pool) {
            Some(u) if *u != up => {
                *u = up;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(n: usize) -> PoolRouter {
        PoolRouter::new((0..n).map(|i| format!("10.0.0.{i}:5555")).collect())
    }

    #[test]
    fn the_same_key_always_picks_the_same_pool() {
        let r = router(3);
        for k in 0..100 {
            let key = format!("k{k}");
            assert_eq!(r.pick(&key), r.pick(&key));
        }
    }

    #[test]
    fn keys_spread_over_pools() {
        let r = router(3);
        let mut n = [0usize; 3];
        for k in 0..3000 {
            n[r.pick(&format!("key-{k}"))] += 1;
        }
        assert!(n.iter().all(|&c| c > 800), "{n:?}");
    }

    #[test]
    fn a_pool_down_does_not_move_requests() {
        let mut r = router(3);
        let before: Vec<usize> = (0..300).map(|k| r.pick(&format!("k{k}"))).collect();
        assert!(r.set_up(1, false));
        assert!(!r.set_up(1, false));
        let after: Vec<usize> = (0..300).map(|k| r.pick(&format!("k{k}"))).collect();
        assert_eq!(before, after);
        assert!(!r.up[1]);
    }

    #[test]
    fn adding_a_pool_moves_only_what_it_wins() {
        let r3 = router(3);
        let r4 = router(4);
        for k in 0..500 {
            let key = format!("k{k}");
            let (a, b) = (r3.pick(&key), r4.pick(&key));
            assert!(a == b || b == 3, "key {key} moved from {a} to {b}");
        }
    }

    #[test]
    fn server_urls_are_checked() {
        assert_eq!(parse_server_urls("a:1, b:2").unwrap(), vec!["a:1", "b:2"]);
        assert!(parse_server_urls("").is_err());
        assert!(parse_server_urls("a:1,,b:2").is_err());
        assert!(parse_server_urls("a:1,a:1").is_err());
    }
}
