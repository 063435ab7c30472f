//! Settings of the metadata core, checked once when the core is built.

/// How long a kept region's agent may stay silent before the region is given back.
pub const DEFAULT_KEEPER_SILENCE_MS: u64 = 30_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaConfig {
    /// Size of one region asked of the RM (bytes).
    pub region_size: u64,
    /// Size of one page, which holds one chunk (bytes).
    pub chunk_size: u64,
    /// The pool's agents (`host:port`); empty: `cxl` sessions only.
    pub agents: Vec<String>,
    /// The RM address handed to workers in the handshake.
    pub rm_address: String,
    /// A session without a request for this long expires.
    pub session_timeout_ms: u64,
    /// A lease ends by itself this long after it was granted.
    pub lease_timeout_ms: u64,
    /// A kept region whose agent does not answer for this long is given back.
    pub keeper_silence_ms: u64,
    /// How often the keeper checks a kept region's mapping at its agent.
    pub keeper_check_ms: u64,
    /// How soon a failed release or free is tried again.
    pub retry_ms: u64,
    /// How often the server asks the RM which regions it holds: well under the RM's
    /// grace period, so that a restarted RM sees this owner back before it reaps.
    pub rm_check_ms: u64,
    /// Most sessions open at a time (expired ones do not count).
    pub max_sessions: usize,
    /// Names this run of maru-server in the handshake: a worker that sees another
    /// instance after reconnecting knows the server restarted and lost its sessions.
    pub instance: String,
    /// How `victims` orders a session's keys.
    pub victim_order: VictimOrder,
    /// A region its session holds without a page taken or a key in it for this long
    /// goes back (a session that never stores gives its regions back): about one
    /// heartbeat of a worker.
    pub unused_region_ms: u64,
    /// A request waiting for a region longer than this is answered "retry" (the
    /// allocation goes on; its region goes to the next request that needs one).
    pub park_max_ms: u64,
    /// Requests waiting for a region at once, all tenants together.
    pub max_parked: usize,
}

/// How long a worker waits between heartbeats for a session timeout (a third of it,
/// within 0.2 to 10 s): the unused-region limit maru-server derives from its
/// `--session-timeout-s`.
pub fn heartbeat_ms(session_timeout_ms: u64) -> u64 {
    (session_timeout_ms / 3).clamp(200, 10_000)
}

/// The order in which `victims` offers a session's keys for eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VictimOrder {
    /// Tails of prefix chains first, a key only once no stored key follows it, in
    /// the order of [`Ranking::Reuse`](super::evict_rank::Ranking::Reuse): by last
    /// use with half a cache of credit per read (reads remembered past an
    /// eviction); then the rest in that order.
    #[default]
    Reuse,
    /// As `Reuse`, and the ends of fresh prompts (stored last in their chain, never
    /// read nor followed since) before every other key: for connectors that store a
    /// prompt's partial last chunk.
    ReuseEnds,
    /// Tails of prefix chains first (least recently used first among them), a key
    /// only once no stored key follows it; then the rest by least recent use.
    PrefixAware,
    /// Least recently used first, chains ignored (kept to measure against).
    Lru,
}

impl VictimOrder {
    /// How the key directory ranks keys under this order.
    pub fn ranking(self) -> super::evict_rank::Ranking {
        match self {
            VictimOrder::Reuse => super::evict_rank::Ranking::Reuse,
            VictimOrder::ReuseEnds => super::evict_rank::Ranking::ReuseEnds,
            VictimOrder::PrefixAware | VictimOrder::Lru => super::evict_rank::Ranking::Recency,
        }
    }

    /// Whether tails of prefix chains go first.
    pub fn tails_first(self) -> bool {
        self != VictimOrder::Lru
    }
}

impl std::str::FromStr for VictimOrder {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "reuse" => Ok(VictimOrder::Reuse),
            "reuse-ends" => Ok(VictimOrder::ReuseEnds),
            "prefix" => Ok(VictimOrder::PrefixAware),
            "lru" => Ok(VictimOrder::Lru),
            other => Err(ConfigError(format!(
                "victim order {:?} is not one of reuse, reuse-ends, prefix, lru",
                other.chars().take(32).collect::<String>()
            ))),
        }
    }
}

/// A fresh instance name (random; the process id and time if no randomness).
#[allow(clippy::disallowed_methods)] // the time only where no randomness is left
pub fn new_instance() -> String {
    crate::auth::random_bytes(8)
        .map(|b| crate::auth::to_hex(&b))
        .unwrap_or_else(|_| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            format!("{}-{t}", std::process::id())
        })
}

impl Default for MetaConfig {
    fn default() -> Self {
        MetaConfig {
            region_size: 1 << 30,
            chunk_size: 4 << 20,
            agents: Vec::new(),
            rm_address: "127.0.0.1:9850".into(),
            session_timeout_ms: 30_000,
            lease_timeout_ms: 60_000,
            keeper_silence_ms: DEFAULT_KEEPER_SILENCE_MS,
            keeper_check_ms: 5_000,
            retry_ms: 1_000,
            rm_check_ms: 1_000,
            max_sessions: 256,
            instance: new_instance(),
            victim_order: VictimOrder::default(),
            unused_region_ms: heartbeat_ms(30_000),
            park_max_ms: 8_000,
            max_parked: 1024,
        }
    }
}

/// A setting that cannot work, with what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("maru-server configuration: {0}")]
pub struct ConfigError(pub String);

impl MetaConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |m: String| Err(ConfigError(m));
        if self.chunk_size == 0 {
            return err("the chunk size must be at least one byte".into());
        }
        if self.region_size < self.chunk_size {
            return err(format!(
                "the region size ({} bytes) is smaller than one chunk ({} bytes)",
                self.region_size, self.chunk_size
            ));
        }
        for (name, v) in [
            ("session timeout", self.session_timeout_ms),
            ("lease timeout", self.lease_timeout_ms),
            ("keeper silence", self.keeper_silence_ms),
            ("keeper check interval", self.keeper_check_ms),
            ("retry interval", self.retry_ms),
            ("RM check interval", self.rm_check_ms),
            ("unused-region limit", self.unused_region_ms),
            ("longest wait for a region", self.park_max_ms),
        ] {
            if v == 0 {
                return err(format!("the {name} must be at least 1 ms"));
            }
        }
        if self.max_sessions == 0 {
            return err("the session limit must be at least 1".into());
        }
        if self.max_parked == 0 {
            return err("the limit of requests waiting for a region must be at least 1".into());
        }
        for (i, a) in self.agents.iter().enumerate() {
            let port_ok = a
                .rsplit_once(':')
                .filter(|(host, _)| !host.is_empty())
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .is_some_and(|p| p != 0);
            if !port_ok {
                return err(format!(
                    "agent {a:?} is not host:port (for example 10.0.0.2:9860)"
                ));
            }
            if self.agents[..i].contains(a) {
                return err(format!("agent {a} is given twice"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_say_what_to_change() {
        assert!(MetaConfig::default().validate().is_ok());
        let bad: [fn(&mut MetaConfig); 7] = [
            |c| c.chunk_size = 0,
            |c| c.region_size = 1,
            |c| c.session_timeout_ms = 0,
            |c| c.max_sessions = 0,
            |c| c.agents = vec!["nohost".into()],
            |c| c.agents = vec![":9860".into()],
            |c| c.agents = vec!["a:1".into(), "a:1".into()],
        ];
        for (i, spoil) in bad.into_iter().enumerate() {
            let mut c = MetaConfig::default();
            spoil(&mut c);
            let Err(e) = c.validate() else {
                panic!("bad setting {i} accepted");
            };
            assert!(!e.to_string().is_empty());
        }
        let ok = MetaConfig {
            agents: vec!["10.0.0.2:9860".into(), "[::1]:9860".into()],
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
    }
}
