//! Grace timers of region owners that have no connection.
//!
//! An owner's regions outlive a dropped connection for a grace period, so a client
//! that reconnects (a network blip, an RM restart) keeps them; an owner that does
//! not come back within the grace period loses them. Timers store when the owner
//! went away, not the deadline, so a grace period configured after start applies to
//! timers already running.

use std::collections::HashMap;

/// Connection counts and grace timers per client id.
#[derive(Debug, Clone)]
pub struct OwnerTimers {
    grace_ms: u64,
    connections: HashMap<String, u32>,
    /// client id → when its last connection went (ms).
    gone_since: HashMap<String, u64>,
}

impl OwnerTimers {
    pub fn new(grace_ms: u64) -> OwnerTimers {
        OwnerTimers {
            grace_ms,
            connections: HashMap::new(),
            gone_since: HashMap::new(),
        }
    }

    pub fn grace_ms(&self) -> u64 {
        self.grace_ms
    }

    pub fn set_grace_ms(&mut self, grace_ms: u64) {
        self.grace_ms = grace_ms;
    }

    /// A connection of `client` opened: its timer (if any) is cancelled.
    pub fn connected(&mut self, client: &str) {
        *self.connections.entry(client.to_string()).or_default() += 1;
        self.gone_since.remove(client);
    }

    /// A connection of `client` closed. When it was the last one and the client owns
    /// regions, its timer starts. Returns whether it started.
    pub fn disconnected(&mut self, client: &str, owns_regions: bool, now_ms: u64) -> bool {
        let left = match self.connections.get_mut(client) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => 0,
        };
        if left > 0 {
            return false;
        }
        self.connections.remove(client);
        if owns_regions {
            self.gone_since.insert(client.to_string(), now_ms);
        }
        owns_regions
    }

    /// Starts `client`'s timer unless it is connected (used at start, when no
    /// connection exists yet).
    pub fn start(&mut self, client: &str, now_ms: u64) {
        if !self.is_connected(client) {
            self.gone_since.entry(client.to_string()).or_insert(now_ms);
        }
    }

    pub fn cancel(&mut self, client: &str) {
        self.gone_since.remove(client);
    }

    pub fn is_connected(&self, client: &str) -> bool {
        self.connections.get(client).is_some_and(|&n| n > 0)
    }

    pub fn is_running(&self, client: &str) -> bool {
        self.gone_since.contains_key(client)
    }

    /// Removes and returns the clients whose grace period is over at `now_ms`.
    pub fn expired(&mut self, now_ms: u64) -> Vec<String> {
        let grace = self.grace_ms;
        let mut out: Vec<String> = self
            .gone_since
            .iter()
            .filter(|(_, &since)| since.saturating_add(grace) <= now_ms)
            .map(|(c, _)| c.clone())
            .collect();
        out.sort();
        for c in &out {
            self.gone_since.remove(c);
        }
        out
    }

    /// When the next grace period ends.
    pub fn next_deadline(&self) -> Option<u64> {
        self.gone_since
            .values()
            .map(|&since| since.saturating_add(self.grace_ms))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_starts_at_last_disconnect_and_reconnect_cancels() {
        let mut t = OwnerTimers::new(100);
        t.connected("a");
        t.connected("a");
        assert!(!t.disconnected("a", true, 10));
        assert_eq!(t.next_deadline(), None);
        assert!(t.disconnected("a", true, 20));
        assert_eq!(t.next_deadline(), Some(120));
        assert!(t.expired(119).is_empty());
        t.connected("a");
        assert_eq!(t.next_deadline(), None);
        assert!(t.expired(1000).is_empty());
    }

    #[test]
    fn no_timer_without_regions_and_grace_applies_late() {
        let mut t = OwnerTimers::new(100);
        t.connected("a");
        assert!(!t.disconnected("a", false, 0));
        assert_eq!(t.next_deadline(), None);
        t.start("b", 50);
        t.set_grace_ms(10);
        assert_eq!(t.next_deadline(), Some(60));
        assert_eq!(t.expired(60), vec!["b".to_string()]);
        assert!(!t.is_running("b"));
    }
}
