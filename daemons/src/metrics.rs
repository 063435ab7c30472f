//! What a daemon counts for Prometheus: requests by operation and result, their
//! latency, bytes, connections (open, refused by reason), failed key proofs, and
//! the gauges of its core (regions, holds, sessions ...), with its version and
//! uptime. Every figure is an atomic, so the event loop updates them and the
//! `/metrics` thread ([`crate::metrics_http`]) renders them without a lock between
//! the two.
//!
//! Names follow Prometheus's conventions: `maru_<daemon>_...`, base units (seconds,
//! bytes), counters ending in `_total`.

use maru::net::NetCounters;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

type Labels = Vec<(&'static str, String)>;

/// The content type of what [`Metrics::render`] writes.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

fn latency_histogram() -> Histogram {
    // 10 µs to about 2.6 s, ×4 a bucket: loopback requests to a slow RM call.
    Histogram::new(exponential_buckets(1e-5, 4.0, 10))
}

fn served_histogram() -> Histogram {
    // 10 µs to about 1.9 s, ×√2 a bucket: fine enough to read a p99 of a fraction of
    // a millisecond to within a fifth.
    Histogram::new(exponential_buckets(1e-5, std::f64::consts::SQRT_2, 36))
}

/// One daemon's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    latency: Family<Labels, Histogram, fn() -> Histogram>,
    served: Family<Labels, Histogram, fn() -> Histogram>,
    loop_busy: Histogram,
    loop_busy_cpu: Histogram,
    bytes: Family<Labels, Counter>,
    connections_open: Gauge,
    connections_accepted: Counter,
    connections_refused: Family<Labels, Counter>,
    auth_failures: Counter,
    request_bytes_buffered: Gauge,
    frame_room_waits: Counter,
    uptime: Gauge<f64, AtomicU64>,
    gauges: BTreeMap<&'static str, Gauge>,
    totals: BTreeMap<&'static str, Counter>,
    /// The event loop's own counters (connections, refusals, key proofs, bytes),
    /// copied into the families above at each render.
    net: OnceLock<Arc<NetCounters>>,
}

impl Metrics {
    /// Metrics of `daemon` (`rm`, `agent`, `server`), with one gauge for each
    /// `(name, help)` of its core.
    pub fn new(daemon: &'static str, gauges: &[(&'static str, &'static str)]) -> Metrics {
        let mut registry = Registry::with_prefix(format!("maru_{daemon}"));
        let info: Family<Labels, Gauge> = Family::default();
        info.get_or_create(&vec![("version", env!("CARGO_PKG_VERSION").to_string())])
            .set(1);
        registry.register("build_info", "The daemon's version (always 1)", info);
        let uptime = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "uptime_seconds",
            "Seconds since the daemon started",
            uptime.clone(),
        );
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "requests",
            "Requests served, by operation and result (ok or the error code)",
            requests.clone(),
        );
        let latency =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to its reply, by operation",
            latency.clone(),
        );
        let served =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(served_histogram);
        registry.register(
            "request_served_seconds",
            "Time from the read of a request's last byte to the write of its reply's last \
             byte, by operation: its wait for the loop, the work, a deferred reply's wait",
            served.clone(),
        );
        let loop_busy = served_histogram();
        registry.register(
            "loop_busy_seconds",
            "Time the event loop worked between two polls: a request that arrived \
             meanwhile waited up to that long, unread",
            loop_busy.clone(),
        );
        let loop_busy_cpu = served_histogram();
        registry.register(
            "loop_busy_cpu_seconds",
            "CPU time the event loop's thread ran in each of those stretches (the rest \
             it waited for a CPU or in a blocking call)",
            loop_busy_cpu.clone(),
        );
        let bytes = Family::<Labels, Counter>::default();
        registry.register(
            "bytes",
            "Bytes received (in) and sent (out) on the daemon's connections",
            bytes.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Client connections open now",
            connections_open.clone(),
        );
        let connections_accepted = Counter::default();
        registry.register(
            "connections_accepted",
            "Client connections accepted since start",
            connections_accepted.clone(),
        );
        let connections_refused = Family::<Labels, Counter>::default();
        registry.register(
            "connections_refused",
            "Connections refused or closed by the daemon, by reason",
            connections_refused.clone(),
        );
        let auth_failures = Counter::default();
        registry.register(
            "auth_failures",
            "Connections whose key proof failed",
            auth_failures.clone(),
        );
        let request_bytes_buffered = Gauge::default();
        registry.register(
            "request_bytes_buffered",
            "Bytes of requests received and not yet served, partly received ones included",
            request_bytes_buffered.clone(),
        );
        let frame_room_waits = Counter::default();
        registry.register(
            "frame_room_waits",
            "Times a request larger than 16 KiB waited, unread, for room (--frame-room-mib)",
            frame_room_waits.clone(),
        );
        let gauges = gauges
            .iter()
            .map(|&(name, help)| {
                let g = Gauge::default();
                registry.register(name, help, g.clone());
                (name, g)
            })
            .collect();
        Metrics {
            registry,
            requests,
            latency,
            served,
            loop_busy,
            loop_busy_cpu,
            bytes,
            connections_open,
            connections_accepted,
            connections_refused,
            auth_failures,
            request_bytes_buffered,
            frame_room_waits,
            uptime,
            gauges,
            totals: BTreeMap::new(),
            net: OnceLock::new(),
        }
    }

    /// Adds one counter for each `(name, help)` of its core whose total the core
    /// keeps (evictions, hits ...): set with [`Metrics::set_total`].
    pub fn with_totals(mut self, totals: &[(&'static str, &'static str)]) -> Metrics {
        for &(name, help) in totals {
            let c = Counter::default();
            self.registry.register(name, help, c.clone());
            self.totals.insert(name, c);
        }
        self
    }

    /// Reads the connection figures from the daemon's event loop from now on.
    pub fn watch_net(&self, counters: Arc<NetCounters>) {
        let _ = self.net.set(counters);
    }

    /// Sets a counter named at [`Metrics::with_totals`] to the core's total (a total
    /// never goes down; a lower value is ignored).
    pub fn set_total(&self, name: &str, total: u64) {
        match self.totals.get(name) {
            Some(c) => raise(c, total),
            None => log::debug!("metrics: no counter {name:?}"),
        }
    }

    fn sync_net(&self) {
        let Some(n) = self.net.get() else {
            return;
        };
        let get = NetCounters::get;
        self.connections_open.set(get(&n.open) as i64);
        raise(&self.auth_failures, get(&n.auth_failures));
        self.request_bytes_buffered.set(get(&n.buffered) as i64);
        raise(&self.frame_room_waits, get(&n.frame_room_waits));
        for (dir, v) in [("in", get(&n.bytes_in)), ("out", get(&n.bytes_out))] {
            raise(
                &self.bytes.get_or_create(&vec![("direction", dir.into())]),
                v,
            );
        }
        for (reason, v) in [
            ("cap", get(&n.refused_cap)),
            ("handshake_pending", get(&n.pushed_out)),
            ("over_share", get(&n.pushed_out_over_share)),
            ("key_revoked", get(&n.key_revoked)),
            ("handshake_timeout", get(&n.handshake_timeouts)),
            ("idle", get(&n.idle_closed)),
            ("protocol", get(&n.protocol_errors)),
        ] {
            raise(
                &self
                    .connections_refused
                    .get_or_create(&vec![("reason", reason.into())]),
                v,
            );
        }
        raise(&self.connections_accepted, get(&n.accepted));
    }

    /// A request of `op` answered with `result` (`ok`, or its error code) after
    /// `seconds`.
    pub fn request(&self, op: &str, result: &str, seconds: f64) {
        self.requests
            .get_or_create(&vec![
                ("op", op.to_string()),
                ("result", result.to_string()),
            ])
            .inc();
        self.latency
            .get_or_create(&vec![("op", op.to_string())])
            .observe(seconds);
    }

    /// A request of `op` was held `seconds` by the daemon, from its read to the
    /// write of its reply ([`maru::net::Service::on_served`]).
    pub fn served(&self, op: &str, seconds: f64) {
        self.served
            .get_or_create(&vec![("op", op.to_string())])
            .observe(seconds);
    }

    /// The event loop worked `wall` seconds between two polls, `cpu` of them on a CPU.
    pub fn loop_busy(&self, wall: f64, cpu: f64) {
        self.loop_busy.observe(wall);
        self.loop_busy_cpu.observe(cpu);
    }

    pub fn bytes_in(&self, n: u64) {
        self.bytes
            .get_or_create(&vec![("direction", "in".into())])
            .inc_by(n);
    }

    pub fn bytes_out(&self, n: u64) {
        self.bytes
            .get_or_create(&vec![("direction", "out".into())])
            .inc_by(n);
    }

    pub fn connection_opened(&self) {
        self.connections_open.inc();
    }

    pub fn connection_closed(&self) {
        self.connections_open.dec();
    }

    /// A connection refused at accept or closed by the daemon (`cap`,
    /// `handshake_timeout`, `idle`, `frame_too_large`, ...).
    pub fn connection_refused(&self, reason: &str) {
        self.connections_refused
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    pub fn auth_failure(&self) {
        self.auth_failures.inc();
    }

    /// Sets a gauge named at [`Metrics::new`]; an unknown name is a bug of the
    /// daemon, logged once per call and otherwise ignored.
    pub fn set(&self, name: &str, value: i64) {
        match self.gauges.get(name) {
            Some(g) => {
                g.set(value);
            }
            None => log::debug!("metrics: no gauge {name:?}"),
        }
    }

    /// The metrics in the Prometheus text format, with the uptime given.
    pub fn render(&self, uptime_seconds: f64) -> String {
        self.uptime.set(uptime_seconds);
        self.sync_net();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// Raises counter `c` to `total` (a counter only grows).
fn raise(c: &Counter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

/// The operation of a request body that decoded (`{"id": 7, "op": "alloc", ...}`):
/// a label value from the daemon's own list of operations, never free text.
pub fn op_of(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Op<'a> {
        #[serde(borrow)]
        op: std::borrow::Cow<'a, str>,
    }
    serde_json::from_slice::<Op>(body)
        .map(|o| o.op.into_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// The operation of request `body` as one of `ops` (`other` when it names none):
/// read from the `"op"` near its start without decoding the body (a metrics label
/// for each request, so it must cost next to nothing), else as [`op_of`] reads it.
pub fn op_label(body: &[u8], ops: &[&'static str]) -> &'static str {
    let head = &body[..body.len().min(96)];
    let named = head.windows(4).position(|w| w == b"\"op\"").and_then(|i| {
        let rest = &head[i + 4..];
        let start = rest.iter().position(|c| *c == b'"')? + 1;
        let len = rest[start..].iter().position(|c| *c == b'"')?;
        Some(&rest[start..start + len])
    });
    let find = |name: &[u8]| ops.iter().copied().find(|o| o.as_bytes() == name);
    match named {
        Some(n) => find(n),
        None => find(op_of(body).as_bytes()),
    }
    .unwrap_or("other")
}

/// `ok`, or the error code of a failed request.
pub fn result_of<T>(r: &Result<T, maru::wire::WireError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => e.code.as_str(),
    }
}

/// When a service copies its core's figures into the gauges: after a change, at most
/// once per `every_ms`, with a deadline so the last change is not left out.
#[derive(Debug)]
pub struct Refresh {
    every_ms: u64,
    last_ms: Option<u64>,
    dirty: bool,
}

impl Refresh {
    pub fn new(every_ms: u64) -> Refresh {
        Refresh {
            every_ms,
            last_ms: None,
            dirty: true,
        }
    }

    /// Something changed.
    pub fn touch(&mut self) {
        self.dirty = true;
    }

    /// Whether the gauges are to be copied now (then they count as fresh).
    pub fn due(&mut self, now_ms: u64) -> bool {
        if self.dirty && self.last_ms.is_none_or(|l| now_ms >= l + self.every_ms) {
            self.last_ms = Some(now_ms);
            self.dirty = false;
            return true;
        }
        false
    }

    /// When the loop must call back to copy a change left waiting.
    pub fn deadline(&self) -> Option<u64> {
        self.dirty
            .then(|| self.last_ms.map_or(0, |l| l + self.every_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exposition format's rules a scraper relies on: every sample's family has
    /// one HELP and one TYPE line before it, names are `[a-zA-Z_:][a-zA-Z0-9_:]*`,
    /// label values are quoted, values parse as floats.
    fn check_format(text: &str) -> Vec<(String, f64)> {
        let mut typed: BTreeMap<String, String> = BTreeMap::new();
        let mut samples = Vec::new();
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.chars().enumerate().all(|(i, c)| {
                    c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
                })
        };
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE name kind");
                assert!(name_ok(name), "{line}");
                assert!(
                    ["counter", "gauge", "histogram", "untyped", "summary"].contains(&kind),
                    "{line}"
                );
                assert!(
                    typed.insert(name.into(), kind.into()).is_none(),
                    "twice: {line}"
                );
                continue;
            }
            if line.starts_with("# HELP ") || line.is_empty() {
                continue;
            }
            assert!(!line.starts_with('#'), "unknown comment {line}");
            let (series, value) = line.rsplit_once(' ').expect("series value");
            let name = series.split('{').next().unwrap();
            assert!(name_ok(name), "{line}");
            if let Some(labels) = series.strip_prefix(name) {
                if !labels.is_empty() {
                    assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
                    for pair in labels[1..labels.len() - 1].split(',') {
                        let (k, v) = pair.split_once('=').expect("k=v");
                        assert!(name_ok(k), "{line}");
                        assert!(v.starts_with('"') && v.ends_with('"'), "{line}");
                    }
                }
            }
            let family = typed
                .keys()
                .filter(|f| name.starts_with(f.as_str()))
                .max_by_key(|f| f.len())
                .unwrap_or_else(|| panic!("no TYPE before {line}"));
            assert!(
                name.len() == family.len() || typed[family] == "histogram",
                "{line}"
            );
            let v: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
            samples.push((series.to_string(), v));
        }
        samples
    }

    fn value(samples: &[(String, f64)], series: &str) -> f64 {
        samples
            .iter()
            .find(|(s, _)| s == series)
            .unwrap_or_else(|| panic!("no {series} in {samples:?}"))
            .1
    }

    #[test]
    fn figures_move_and_render_in_the_exposition_format() {
        let m = Metrics::new("rm", &[("regions", "Regions allocated")]);
        m.request("alloc", "ok", 0.0002);
        m.request("alloc", "ok", 0.0004);
        m.request("alloc", "no_space", 0.001);
        m.bytes_in(100);
        m.bytes_out(40);
        m.connection_opened();
        m.connection_opened();
        m.connection_closed();
        m.connection_refused("cap");
        m.auth_failure();
        m.set("regions", 7);
        m.set("no_such_gauge", 1);
        let text = m.render(12.5);
        let s = check_format(&text);
        assert_eq!(
            value(&s, r#"maru_rm_requests_total{op="alloc",result="ok"}"#),
            2.0
        );
        assert_eq!(
            value(
                &s,
                r#"maru_rm_requests_total{op="alloc",result="no_space"}"#
            ),
            1.0
        );
        assert_eq!(
            value(&s, r#"maru_rm_request_duration_seconds_count{op="alloc"}"#),
            3.0
        );
        assert_eq!(value(&s, r#"maru_rm_bytes_total{direction="in"}"#), 100.0);
        assert_eq!(value(&s, "maru_rm_connections_open"), 1.0);
        assert_eq!(
            value(&s, r#"maru_rm_connections_refused_total{reason="cap"}"#),
            1.0
        );
        assert_eq!(value(&s, "maru_rm_auth_failures_total"), 1.0);
        assert_eq!(value(&s, "maru_rm_regions"), 7.0);
        assert_eq!(value(&s, "maru_rm_uptime_seconds"), 12.5);
        let version = format!(
            r#"maru_rm_build_info{{version="{}"}}"#,
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(value(&s, &version), 1.0);
        // Histogram buckets are cumulative and end with +Inf = count.
        assert!(
            text.contains("maru_rm_connections_accepted_total 0"),
            "{text}"
        );
        assert_eq!(
            value(
                &s,
                r#"maru_rm_request_duration_seconds_bucket{op="alloc",le="+Inf"}"#
            ),
            3.0
        );
    }

    #[test]
    fn loop_counters_and_core_totals_only_grow() {
        let m = Metrics::new("agent", &[]).with_totals(&[("evictions", "Keys evicted")]);
        let net = Arc::new(NetCounters::default());
        m.watch_net(net.clone());
        net.open.store(3, std::sync::atomic::Ordering::Relaxed);
        net.accepted.store(5, std::sync::atomic::Ordering::Relaxed);
        net.auth_failures
            .store(2, std::sync::atomic::Ordering::Relaxed);
        net.refused_cap
            .store(1, std::sync::atomic::Ordering::Relaxed);
        net.bytes_in.store(10, std::sync::atomic::Ordering::Relaxed);
        net.buffered.store(7, std::sync::atomic::Ordering::Relaxed);
        net.frame_room_waits
            .store(2, std::sync::atomic::Ordering::Relaxed);
        m.set_total("evictions", 4);
        let s = check_format(&m.render(1.0));
        assert_eq!(value(&s, "maru_agent_connections_open"), 3.0);
        assert_eq!(value(&s, "maru_agent_connections_accepted_total"), 5.0);
        assert_eq!(value(&s, "maru_agent_auth_failures_total"), 2.0);
        assert_eq!(
            value(&s, r#"maru_agent_connections_refused_total{reason="cap"}"#),
            1.0
        );
        assert_eq!(value(&s, r#"maru_agent_bytes_total{direction="in"}"#), 10.0);
        assert_eq!(value(&s, "maru_agent_request_bytes_buffered"), 7.0);
        assert_eq!(value(&s, "maru_agent_frame_room_waits_total"), 2.0);
        assert_eq!(value(&s, "maru_agent_evictions_total"), 4.0);
        // A lower total (never sent by a core) leaves the counter as it was.
        m.set_total("evictions", 1);
        let s = check_format(&m.render(2.0));
        assert_eq!(value(&s, "maru_agent_evictions_total"), 4.0);
    }

    #[test]
    fn the_op_label_comes_from_the_request_and_refresh_is_bounded() {
        assert_eq!(op_of(br#"{"id":1,"op":"alloc","size":2}"#), "alloc");
        assert_eq!(op_of(b"not json"), "unknown");
        let ops = &["alloc", "exists"];
        assert_eq!(
            op_label(br#"{"id":1,"op":"exists","keys":[]}"#, ops),
            "exists"
        );
        assert_eq!(op_label(br#"{"id": 1, "op" : "alloc"}"#, ops), "alloc");
        let late = format!(r#"{{"pad":"{}","id":1,"op":"alloc"}}"#, "x".repeat(200));
        assert_eq!(
            op_label(late.as_bytes(), ops),
            "alloc",
            "past the head: decoded"
        );
        assert_eq!(op_label(br#"{"id":1,"op":"drop_tables"}"#, ops), "other");
        assert_eq!(op_label(b"not json", ops), "other");
        let mut r = Refresh::new(1000);
        assert!(r.due(0), "the first copy is at once");
        assert_eq!(r.deadline(), None, "nothing waits");
        r.touch();
        assert!(!r.due(500), "at most once a second");
        assert_eq!(
            r.deadline(),
            Some(1000),
            "the change waiting is copied then"
        );
        assert!(r.due(1000));
        assert!(!r.due(5000), "nothing changed");
    }
}
