//! The table maru-usage prints: a [`Snapshot`] rendered as text.

use crate::snapshot::*;
use maru::wire::meta::SkipCounts;
use maru::worker::skips::SkipReason;
use std::fmt::Write as _;

pub(crate) use maru_daemons::rm_tables::{self, mib};

pub(crate) fn rate(h: u64, m: u64) -> String {
    if h + m == 0 {
        "-".to_string()
    } else {
        format!("{:.1}%", 100.0 * h as f64 / (h + m) as f64)
    }
}

/// Skip counts as `reason:count` of the reasons that skipped, `0` when none did.
pub(crate) fn skips(c: &SkipCounts) -> String {
    let v: Vec<String> = SkipReason::ALL
        .iter()
        .filter(|r| c.get(**r) > 0)
        .map(|r| format!("{}:{}", r.as_str(), c.get(*r)))
        .collect();
    if v.is_empty() {
        "0".into()
    } else {
        v.join(",")
    }
}

pub(crate) fn joined<T: AsRef<str>>(set: impl IntoIterator<Item = T>) -> String {
    let v: Vec<String> = set.into_iter().map(|s| s.as_ref().to_string()).collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join(",")
    }
}

/// The tables of one snapshot.
pub(crate) fn render(s: &Snapshot, max_regions: usize) -> String {
    let mut o = String::new();
    let t = &s.stats.total;
    let _ = writeln!(
        o,
        "maru-server {} ({}): {} sessions, {} regions ({} MiB), {} keys ({} MiB), hit rate {} ({} hits, {} misses), {} leases, {} pinned keys",
        s.server, s.server_info.text(), t.sessions, t.regions, mib(t.region_bytes), t.keys, mib(t.key_bytes),
        rate(t.hits, t.misses), t.hits, t.misses, t.leases, t.pinned_keys
    );
    let _ = writeln!(
        o,
        "region keeper: {} regions kept ({} MiB, {} keys, readable), {} going back ({} MiB)",
        s.usage.kept_regions,
        mib(s.usage.kept_bytes),
        t.kept_keys,
        s.usage.giving_back,
        mib(s.usage.giving_back_bytes)
    );
    let _ = writeln!(
        o,
        "eviction: {} keys removed by their engines ({} of them cut a prefix chain), {} regions given back for a fair share, {} engines waiting for a region",
        t.removed, t.chains_cut, t.fair_share_returns, t.waiting_for_region
    );
    let _ = writeln!(
        o,
        "skipped chunks (stores not stored, as the workers' last heartbeats said): {}",
        skips(&t.skipped)
    );
    if t.recovery_ms > 0 || t.recovered_keys > 0 {
        let _ = writeln!(
            o,
            "durable directory: its last start recovered {} keys in {} regions in {} ms",
            t.recovered_keys, t.recovered_regions, t.recovery_ms
        );
    }
    if t.pages_in_doubt > 0 || t.pages_in_doubt_freed > 0 {
        let _ = writeln!(
            o,
            "pages found allocated without a key at the last start: {} freed as their sessions said which they hold, {} not (yet) freed",
            t.pages_in_doubt_freed, t.pages_in_doubt
        );
    }
    let _ = writeln!(o);
    if !s.tenants.is_empty() {
        let _ = writeln!(o, "tenants shown (--tenant): {}", s.tenants.join(", "));
    }
    let _ = writeln!(
        o,
        "{:<12} {:<24} {:<16} {:<11} {:>4} {:>7} {:>9} {:>8} {:>7} {:>8} {:>8} {:>8} {:>7} {:>6} {:>5} {:>5} {:>7}",
        "TENANT",
        "ENGINE",
        "NAMESPACE",
        "BACKEND",
        "SESS",
        "REGIONS",
        "ALLOC_MiB",
        "USED_MiB",
        "KEYS",
        "KEY_MiB",
        "HITS",
        "MISSES",
        "HIT%",
        "LEASES",
        "PINS",
        "CONN",
        "SKIPPED"
    );
    let rows = engines(&s.stats, &s.usage);
    if rows.is_empty() && s.tenants.is_empty() {
        let _ = writeln!(o, "(no engine has a session)");
    } else if rows.is_empty() {
        let _ = writeln!(o, "(no engine of these tenants has a session)");
    }
    for ((tenant, engine), r) in &rows {
        let _ = writeln!(
            o,
            "{:<12} {:<24} {:<16} {:<11} {:>4} {:>7} {:>9} {:>8} {:>7} {:>8} {:>8} {:>8} {:>7} {:>6} {:>5} {:>5} {:>7}",
            if tenant.is_empty() { "-" } else { tenant },
            engine,
            joined(&r.namespaces),
            joined(r.backends.iter()),
            r.sessions,
            r.regions,
            mib(r.allocated),
            mib(r.used),
            r.keys,
            mib(r.key_bytes),
            r.hits,
            r.misses,
            rate(r.hits, r.misses),
            r.leases,
            r.pins,
            format!("{}/{}", r.connected, r.sessions),
            skips(&r.skipped)
        );
    }
    if !s.agents.is_empty() {
        render_agents(&mut o, &s.agents);
    }
    if let Some(rm) = &s.rm {
        let _ = writeln!(o);
        if let Some(e) = &rm.error {
            let _ = writeln!(o, "resource manager {}: {e}", rm.address);
            return o;
        }
        let _ = writeln!(o, "resource manager {} ({}):", rm.address, rm.info.text());
        o.push_str(&rm_tables::pools(&rm.pools, Some(&rm.regions)));
        let _ = writeln!(o);
        o.push_str(&rm_tables::regions(
            &rm.regions[..rm.regions.len().min(max_regions)],
        ));
        if rm.regions.len() > max_regions {
            let _ = writeln!(
                o,
                "... and {} more regions (--max-regions)",
                rm.regions.len() - max_regions
            );
        }
    }
    o
}

/// The agents' table: one line each, an error line for one that did not answer.
pub(crate) fn render_agents(o: &mut String, agents: &[AgentView]) {
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<22} {:<12} {:<36} {:>8} {:>7} {:>5} {:>8} {:>7} {:>6} {:<8} {:>7}",
        "AGENT",
        "NODE",
        "BOOT_ID",
        "MAPPINGS",
        "HOLDERS",
        "REGS",
        "RELEASED",
        "QUARANT",
        "UNHOLD",
        "VERSION",
        "UPTIME"
    );
    for a in agents {
        let Some(st) = &a.status else {
            let _ = writeln!(
                o,
                "{:<22} {}",
                a.address,
                a.error.as_deref().unwrap_or("no status")
            );
            continue;
        };
        let holders: usize = st.mappings.iter().map(|m| m.holders.len()).sum();
        let regs: usize = st.mappings.iter().map(|m| m.registrations).sum();
        let released = st.mappings.iter().filter(|m| m.released).count();
        let _ = writeln!(
            o,
            "{:<22} {:<12} {:<36} {:>8} {:>7} {:>5} {:>8} {:>7} {:>6} {:<8} {:>7}",
            a.address,
            st.node,
            st.boot_id,
            st.mappings.len(),
            holders,
            regs,
            released,
            st.quarantined,
            format!(
                "{}{}",
                st.queued_unholds,
                if st.holds_reset_pending { "+R" } else { "" }
            ),
            a.info.version.as_deref().unwrap_or("?"),
            a.info.uptime_s.map_or("?".into(), uptime)
        );
    }
}
