//! `maru-usage --metrics ADDR`: a [`Snapshot`] as Prometheus text, summed per tenant.

use crate::snapshot::*;
use maru::wire::meta::{StatsReply, UsageReply};
use maru::worker::skips::SkipReason;
use std::collections::BTreeMap;

/// Per tenant: its sessions summed as the table's rows are (a session that opened or
/// ended between the two reads counts with what one of them said).
pub(crate) fn tenant_sums(stats: &StatsReply, usage: &UsageReply) -> BTreeMap<String, EngineRow> {
    summed(stats, usage, |tenant, _| tenant.to_string())
}

/// The text format of `maru-usage --metrics`: the last snapshot (`None`: the last read
/// of maru-server failed, so only `maru_usage_up 0`).
pub(crate) fn metrics_text(snap: Option<&Snapshot>) -> String {
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;
    type L = Vec<(&'static str, String)>;
    let mut reg = Registry::with_prefix("maru_usage");
    let up = Gauge::<i64>::default();
    up.set(i64::from(snap.is_some()));
    reg.register("up", "1 when the last read of maru-server succeeded", up);
    let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    if let Some(s) = snap {
        let sums = tenant_sums(&s.stats, &s.usage);
        for (name, help, get) in [
            (
                "tenant_sessions",
                "Live sessions of the tenant",
                (|t: &EngineRow| t.sessions) as fn(&EngineRow) -> u64,
            ),
            (
                "tenant_regions",
                "Regions the tenant's sessions hold",
                |t| t.regions,
            ),
            (
                "tenant_region_bytes",
                "Bytes of the regions the tenant's sessions hold (its use of the pool)",
                |t| t.allocated,
            ),
            (
                "tenant_used_bytes",
                "Bytes of the pages in use in those regions",
                |t| t.used,
            ),
            (
                "tenant_keys",
                "Published keys in the tenant's sessions' regions",
                |t| t.keys,
            ),
            (
                "tenant_hits",
                "Keys the tenant's live sessions found (since each opened)",
                |t| t.hits,
            ),
            (
                "tenant_misses",
                "Keys the tenant's live sessions did not find (since each opened)",
                |t| t.misses,
            ),
        ] {
            let f = Family::<L, Gauge>::default();
            for (tenant, t) in &sums {
                f.get_or_create(&vec![("tenant", tenant.clone())])
                    .set(g(get(t)));
            }
            reg.register(name, help, f);
        }
        let f = Family::<L, Gauge>::default();
        for (tenant, t) in &sums {
            for r in SkipReason::ALL {
                f.get_or_create(&vec![
                    ("tenant", tenant.clone()),
                    ("reason", r.as_str().to_string()),
                ])
                .set(g(t.skipped.get(r)));
            }
        }
        reg.register(
            "tenant_skipped_chunks",
            "Chunks the tenant's workers skipped storing, by reason, as their last heartbeats said",
            f,
        );
        let f = Family::<L, Gauge>::default();
        for r in SkipReason::ALL {
            f.get_or_create(&vec![("reason", r.as_str().to_string())])
                .set(g(s.stats.total.skipped.get(r)));
        }
        reg.register(
            "skipped_chunks",
            "Chunks the open sessions' workers skipped storing, by reason, summed",
            f,
        );
        if !s.agents.is_empty() {
            let f = Family::<L, Gauge>::default();
            for a in &s.agents {
                let node = a
                    .status
                    .as_ref()
                    .map(|st| st.node.clone())
                    .unwrap_or_default();
                f.get_or_create(&vec![("agent", a.address.clone()), ("node", node)])
                    .set(i64::from(a.status.is_some()));
            }
            reg.register(
                "agent_up",
                "1 when the agent (a memory node) answered its status request, 0 when not",
                f,
            );
        }
    }
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &reg) {
        log::error!("metrics: cannot encode: {e}");
    }
    out
}
