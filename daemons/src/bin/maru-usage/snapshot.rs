//! What maru-usage read from the daemons (one [`Snapshot`]), and the engines' rows
//! of the table summed from maru-server's statistics and usage.

use maru::net::Client;
use maru::wire::agent::StatusReply;
use maru::wire::meta::{self, SkipCounts, StatsReply, UsageReply};
use maru::wire::rm::{PoolInfo, RegionInfo};
use std::collections::{BTreeMap, BTreeSet};

/// What one refresh read.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Snapshot {
    pub(crate) server: String,
    /// maru-server's version and uptime (its welcome).
    pub(crate) server_info: DaemonInfo,
    /// --tenant: the tenants whose sessions `stats` and `usage` keep (empty: all).
    pub(crate) tenants: Vec<String>,
    pub(crate) stats: StatsReply,
    pub(crate) usage: UsageReply,
    /// With --rm: the RM's address and what it answered (or why not).
    pub(crate) rm: Option<RmView>,
    /// With --agent-key-file: each agent's status (or why not).
    pub(crate) agents: Vec<AgentView>,
}

/// A daemon's version and uptime, from the welcome of the connection.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct DaemonInfo {
    pub(crate) version: Option<String>,
    pub(crate) uptime_s: Option<u64>,
}

impl DaemonInfo {
    pub(crate) fn of(c: &Client) -> DaemonInfo {
        let i = &c.welcome().info;
        DaemonInfo {
            version: i
                .get("version")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            uptime_s: i.get("uptime_s").and_then(|v| v.as_u64()),
        }
    }

    pub(crate) fn text(&self) -> String {
        format!(
            "version {}, up {}",
            self.version.as_deref().unwrap_or("?"),
            self.uptime_s.map_or("?".into(), uptime)
        )
    }
}

pub(crate) fn uptime(s: u64) -> String {
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86399 => format!("{}h{:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d{:02}h", s / 86400, s / 3600 % 24),
    }
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct RmView {
    pub(crate) address: String,
    pub(crate) info: DaemonInfo,
    pub(crate) pools: Vec<PoolInfo>,
    pub(crate) regions: Vec<RegionInfo>,
    pub(crate) error: Option<String>,
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct AgentView {
    pub(crate) address: String,
    pub(crate) info: DaemonInfo,
    pub(crate) status: Option<StatusReply>,
    pub(crate) error: Option<String>,
}

/// The sessions of one engine, summed.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct EngineRow {
    pub(crate) sessions: u64,
    pub(crate) namespaces: BTreeSet<String>,
    pub(crate) backends: BTreeSet<&'static str>,
    pub(crate) regions: u64,
    pub(crate) allocated: u64,
    pub(crate) used: u64,
    pub(crate) keys: u64,
    pub(crate) key_bytes: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) leases: u64,
    pub(crate) pins: u64,
    pub(crate) connected: u64,
    /// Chunks its stores skipped, per reason, as its sessions' last heartbeats said.
    pub(crate) skipped: SkipCounts,
}

impl EngineRow {
    /// What the usage reply says of one session: its namespace, bytes allocated and in
    /// use, whether it is connected.
    fn add_usage(&mut self, u: &meta::SessionUsage) {
        self.namespaces.insert(u.namespace.clone());
        self.allocated += u.allocated;
        self.used += u.used;
        self.connected += u.connected as u64;
    }
}

/// Who a row of the table is: a tenant and an engine id of it.
pub(crate) type RowKey = (String, String);

/// Per tenant and engine id: the sessions of the stats reply joined with those of the
/// usage reply by session id (a session that opened or ended between the two calls
/// counts with what one of them said).
pub(crate) fn engines(stats: &StatsReply, usage: &UsageReply) -> BTreeMap<RowKey, EngineRow> {
    summed(stats, usage, |tenant, engine| {
        (tenant.to_string(), engine.to_string())
    })
}

/// The sessions of both replies, joined as [`engines`] joins them, summed per
/// `key(tenant, engine id)`: the table's rows and `--metrics`' tenants.
pub(crate) fn summed<K: Ord>(
    stats: &StatsReply,
    usage: &UsageReply,
    key: impl Fn(&str, &str) -> K,
) -> BTreeMap<K, EngineRow> {
    let mut out: BTreeMap<K, EngineRow> = BTreeMap::new();
    let by_id: BTreeMap<u64, &meta::SessionUsage> =
        usage.sessions.iter().map(|u| (u.session, u)).collect();
    let mut seen = BTreeSet::new();
    for s in &stats.sessions {
        seen.insert(s.session);
        let row = out.entry(key(&s.tenant, &s.engine_id)).or_default();
        row.sessions += 1;
        row.regions += s.regions;
        row.keys += s.keys;
        row.key_bytes += s.key_bytes;
        row.hits += s.hits;
        row.misses += s.misses;
        row.leases += s.leases;
        row.pins += s.pins;
        row.skipped.add(&s.skipped);
        if let Some(b) = s.backend {
            row.backends.insert(b.as_str());
        }
        match by_id.get(&s.session) {
            Some(u) => row.add_usage(u),
            None => row.allocated += s.region_bytes,
        }
    }
    for u in usage.sessions.iter().filter(|u| !seen.contains(&u.session)) {
        let row = out.entry(key(&u.tenant, &u.engine_id)).or_default();
        row.sessions += 1;
        row.regions += u.regions;
        row.backends.insert(u.backend.as_str());
        row.add_usage(u);
    }
    out
}

/// Keeps only the sessions of `tenants` (none named: every session).
pub(crate) fn keep_tenants(stats: &mut StatsReply, usage: &mut UsageReply, tenants: &[String]) {
    if tenants.is_empty() {
        return;
    }
    stats.sessions.retain(|s| tenants.contains(&s.tenant));
    usage.sessions.retain(|u| tenants.contains(&u.tenant));
}
