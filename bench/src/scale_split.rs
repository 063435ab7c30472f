//! Where a scale step's request latency goes (`scale.md`'s "where the time goes"):
//! the engines' figure (request sent to reply read) beside maru-server's own
//! (`maru_server_request_served_seconds`: the read of the request's last byte to the
//! write of its reply's last byte, scraped from `--metrics` before and after the
//! step), the time the engines' threads waited for a CPU during their calls (their
//! run-queue time), their latency less that wait, how late their paced threads woke,
//! and how long maru-server's loop thread waited for a CPU.
//!
//! On a 2-core machine the simulated engines, maru-server's threads, the RM and
//! whatever else runs share the cores: a reply written in time whose engine thread
//! then waits for a core counts late at the engine. These figures tell that apart
//! from time spent in maru-server.

use crate::report::Table;
use crate::scale_agent::{lat, Lat};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

/// The operations the table shows, and `all` (every request but open and close).
const SHOWN: &[&str] = &["exists", "publish", "heartbeat", "all"];

/// What a step's split holds (part of [`Step`]).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Split {
    /// The 1-minute load average when the step started.
    pub load: String,
    /// maru-server's own time per operation (from its histogram: p50/p99 read within
    /// their bucket, ×√2 wide; `max_us` is the upper bound of the highest bucket hit).
    pub served: Vec<(String, Lat)>,
    /// The engines' latency less their thread's wait for a CPU during the call.
    pub less_cpu_wait: Vec<(String, Lat)>,
    /// The engines' threads' wait for a CPU during their calls.
    pub cpu_wait: Vec<(String, Lat)>,
    /// How late the engines' paced threads woke for their turns (µs).
    pub woke_late: Lat,
    /// maru-server's loop thread's wait for a CPU over the step, ms per second.
    pub loop_cpu_wait_ms_per_s: f64,
    /// maru-server's loop's busy stretches (between two polls) in the window, and
    /// how many were over 1 ms (its histogram's bound at or under 1 ms: 905 µs).
    pub loop_busy: Lat,
    pub loop_busy_over_1ms: f64,
    /// The loop thread's CPU time in those stretches: what maru-server did, without
    /// its waits for a CPU.
    #[serde(default)]
    pub loop_busy_cpu: Lat,
    #[serde(default)]
    pub loop_busy_cpu_over_1ms: f64,
    /// The same while the engines closed their sessions after the window (the
    /// regions of those without keys given back to the RM, one call each).
    pub closing_busy: Lat,
    pub closing_busy_over_1ms: f64,
    /// Of which on a CPU (the rest: waits for a CPU, or for the RM's answers to the
    /// frees of those regions, one call each).
    #[serde(default)]
    pub closing_busy_cpu: Lat,
    #[serde(default)]
    pub closing_busy_cpu_over_1ms: f64,
}

/// A free port on loopback for maru-server's `--metrics`.
pub fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("a free port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("a free port: {e}"))
}

/// `/metrics` of the daemon at `127.0.0.1:port`.
pub fn scrape(port: u16) -> Result<String, String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .map_err(|e| format!("metrics at port {port}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .map_err(|e| format!("metrics at port {port}: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .map_err(|e| format!("metrics at port {port}: {e}"))?;
    Ok(text)
}

/// Cumulative buckets of one histogram: (upper bound in seconds, count).
type Buckets = Vec<(f64, f64)>;

/// maru-server's histograms as one scrape read them.
#[derive(Debug, Clone, Default)]
pub struct ServerHistograms {
    /// Its own time per request, by operation.
    pub served: BTreeMap<String, Buckets>,
    /// Its loop's busy stretches (one histogram, under ""), and its thread's CPU
    /// time in each.
    pub busy: BTreeMap<String, Buckets>,
    pub busy_cpu: BTreeMap<String, Buckets>,
}

impl ServerHistograms {
    pub fn scrape(port: u16) -> Result<ServerHistograms, String> {
        let text = scrape(port)?;
        Ok(ServerHistograms {
            served: histograms(&text, "maru_server_request_served_seconds"),
            busy: histograms(&text, "maru_server_loop_busy_seconds"),
            busy_cpu: histograms(&text, "maru_server_loop_busy_cpu_seconds"),
        })
    }
}

/// maru-server's side of a step from three scrapes: before it, at the end of its
/// window, and once the engines closed their sessions.
pub fn server_side(
    split: &mut Split,
    before: &ServerHistograms,
    end: &ServerHistograms,
    closed: &ServerHistograms,
) {
    split.served = step_buckets(&before.served, &end.served)
        .iter()
        .map(|(op, b)| (op.clone(), lat_of_buckets(b)))
        .collect();
    (split.loop_busy, split.loop_busy_over_1ms) = stretches(&before.busy, &end.busy);
    (split.loop_busy_cpu, split.loop_busy_cpu_over_1ms) =
        stretches(&before.busy_cpu, &end.busy_cpu);
    (split.closing_busy, split.closing_busy_over_1ms) = stretches(&end.busy, &closed.busy);
    (split.closing_busy_cpu, split.closing_busy_cpu_over_1ms) =
        stretches(&end.busy_cpu, &closed.busy_cpu);
}

/// The loop's stretches between two scrapes of one of its histograms (one, under ""):
/// their latencies and how many were over 1 ms.
fn stretches(before: &BTreeMap<String, Buckets>, after: &BTreeMap<String, Buckets>) -> (Lat, f64) {
    let b = step_buckets(before, after).remove("").unwrap_or_default();
    (lat_of_buckets(&b), over(&b, 1e-3))
}

/// How many of the histogram's samples were above `s` seconds (above the largest
/// bucket bound at or under it).
fn over(b: &Buckets, s: f64) -> f64 {
    let total = b.last().map_or(0.0, |x| x.1);
    let under = b
        .iter()
        .rev()
        .find(|x| x.0 <= s * 1.0001)
        .map_or(0.0, |x| x.1);
    total - under
}

/// The buckets of histogram `family` by its `op` label (under "" without one), from
/// a scrape.
pub fn histograms(text: &str, family: &str) -> BTreeMap<String, Buckets> {
    let prefix = format!("{family}_bucket{{");
    let mut out: BTreeMap<String, Buckets> = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with(&prefix)) {
        let label = |name: &str| {
            let at = line.find(&format!("{name}=\""))? + name.len() + 2;
            let len = line[at..].find('"')?;
            Some(&line[at..at + len])
        };
        let Some(le) = label("le") else {
            continue;
        };
        let op = label("op").unwrap_or("");
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::INFINITY)
        };
        let n: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        out.entry(op.to_string()).or_default().push((le, n));
    }
    for b in out.values_mut() {
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
    }
    out
}

/// `after` less `before`, bucket by bucket; `all` added: every op but open and close.
pub fn step_buckets(
    before: &BTreeMap<String, Buckets>,
    after: &BTreeMap<String, Buckets>,
) -> BTreeMap<String, Buckets> {
    let mut out: BTreeMap<String, Buckets> = BTreeMap::new();
    for (op, b) in after {
        let was = before.get(op);
        let d: Buckets = b
            .iter()
            .map(|(le, n)| {
                let n0 = was
                    .and_then(|w| w.iter().find(|x| x.0 == *le))
                    .map_or(0.0, |x| x.1);
                (*le, n - n0)
            })
            .collect();
        if !matches!(op.as_str(), "open_session" | "close" | "") {
            let all = out
                .entry("all".into())
                .or_insert_with(|| d.iter().map(|(le, _)| (*le, 0.0)).collect());
            for (a, x) in all.iter_mut().zip(&d) {
                a.1 += x.1;
            }
        }
        out.insert(op.clone(), d);
    }
    out
}

/// The `q` quantile of cumulative `buckets` in µs, read linearly within its bucket
/// (the first bucket from 0; one past the last finite bound is that bound).
pub fn quantile_us(buckets: &Buckets, q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    if total <= 0.0 {
        return 0.0;
    }
    let want = q * total;
    let mut lo = (0.0, 0.0);
    for &(le, n) in buckets {
        if n >= want {
            if !le.is_finite() {
                return lo.0 * 1e6;
            }
            let frac = if n > lo.1 {
                (want - lo.1) / (n - lo.1)
            } else {
                1.0
            };
            return (lo.0 + (le - lo.0) * frac) * 1e6;
        }
        lo = (le, n);
    }
    lo.0 * 1e6
}

/// p50/p99 of a histogram's step buckets.
pub fn lat_of_buckets(b: &Buckets) -> Lat {
    let top = b
        .iter()
        .zip(std::iter::once(&(0.0, 0.0)).chain(b.iter()))
        .filter(|(x, prev)| x.1 > prev.1)
        .map(|(x, _)| x.0)
        .last()
        .unwrap_or(0.0);
    Lat {
        count: b.last().map_or(0.0, |x| x.1) as usize,
        p50_us: quantile_us(b, 0.5),
        p99_us: quantile_us(b, 0.99),
        max_us: top * 1e6,
    }
}

/// Nanoseconds the threads of `pid` named `name` waited for a CPU since they started.
pub fn thread_cpu_wait_ns(pid: u32, name: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    dir.flatten()
        .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == name))
        .filter_map(|e| {
            let s = std::fs::read_to_string(e.path().join("schedstat")).ok()?;
            s.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum()
}

/// The engines' samples of one step, by operation: (latency, wait for a CPU), µs.
#[derive(Default)]
pub struct EngineSamples {
    pub by_op: BTreeMap<String, Vec<(f64, f64)>>,
    pub late: Vec<f64>,
}

impl EngineSamples {
    /// Adds one simulator's record (its `lat`, `cpu_wait` and `late`).
    pub fn add(&mut self, record: &serde_json::Value) {
        for (op, lat) in record["lat"].as_object().into_iter().flatten() {
            let waits = record["cpu_wait"][op].as_array();
            let v = self.by_op.entry(op.clone()).or_default();
            for (i, x) in lat.as_array().into_iter().flatten().enumerate() {
                let w = waits
                    .and_then(|w| w.get(i))
                    .and_then(|w| w.as_f64())
                    .unwrap_or(0.0);
                v.push((x.as_f64().unwrap_or(0.0), w));
            }
        }
        self.late.extend(
            record["late"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|x| x.as_f64()),
        );
    }

    /// The split of the engines' side into `split` (`less_cpu_wait`, `cpu_wait`,
    /// `woke_late`), for the shown operations and `all`.
    pub fn fill(&self, split: &mut Split) {
        for op in SHOWN {
            let samples: Vec<(f64, f64)> = if *op == "all" {
                self.by_op
                    .iter()
                    .filter(|(o, _)| !matches!(o.as_str(), "open" | "close"))
                    .flat_map(|(_, v)| v.iter().copied())
                    .collect()
            } else {
                self.by_op.get(*op).cloned().unwrap_or_default()
            };
            split.less_cpu_wait.push((
                op.to_string(),
                lat(samples.iter().map(|(l, w)| (l - w).max(0.0)).collect()),
            ));
            split
                .cpu_wait
                .push((op.to_string(), lat(samples.iter().map(|s| s.1).collect())));
        }
        split.woke_late = lat(self.late.clone());
    }
}

/// What the table shows of one step (a `scale::Step`).
pub struct StepView<'a> {
    pub name: &'a str,
    /// The engines' latencies by operation.
    pub ops: &'a [(String, Lat)],
    /// The engines' latency of every request but open and close.
    pub all: &'a Lat,
    pub split: &'a Split,
}

/// The engines' own figure of `op` in step `s` (`all`: every op but open and close).
fn engines(s: &StepView<'_>, op: &str) -> Option<Lat> {
    if op == "all" {
        return Some(s.all.clone());
    }
    s.ops.iter().find(|(o, _)| o == op).map(|(_, l)| l.clone())
}

fn find<'a>(v: &'a [(String, Lat)], op: &str) -> Option<&'a Lat> {
    v.iter().find(|(o, _)| o == op).map(|(_, l)| l)
}

fn pair(l: Option<&Lat>) -> String {
    l.map_or("-".into(), |l| format!("{:.0} / {:.0}", l.p50_us, l.p99_us))
}

/// The loop's busy stretches as "p99 / max µs (how many over 0.9 ms)".
fn busy(l: &Lat, over_1ms: f64) -> String {
    format!("{:.0} / {:.0} ({over_1ms:.0})", l.p99_us, l.max_us)
}

/// The table "where the time goes", one row per step and operation shown.
pub fn table(steps: &[StepView<'_>]) -> Table {
    let mut t = Table::new(
        "Where the time goes: p50 / p99 µs of each request as the engines saw it, in maru-server (read of the request's last byte to write of the reply's last byte, its histogram), and the engines' figure less their own thread's wait for a CPU during the call",
        &[
            "step",
            "load",
            "op",
            "engines",
            "in maru-server",
            "engines less their CPU wait",
            "engines' CPU wait",
            "engines woke late",
            "server loop's CPU wait ms/s",
            "server loop busy p99 / max µs (over 0.9 ms)",
            "of which on a CPU p99 / max µs (over 0.9 ms)",
            "closing the sessions: loop busy max µs (over 0.9 ms), on a CPU",
        ],
    );
    for s in steps {
        // The step's own columns, on its first row only.
        let step = [s.name.to_string(), s.split.load.clone()];
        let loop_side = [
            pair(Some(&s.split.woke_late)),
            format!("{:.1}", s.split.loop_cpu_wait_ms_per_s),
            busy(&s.split.loop_busy, s.split.loop_busy_over_1ms),
            busy(&s.split.loop_busy_cpu, s.split.loop_busy_cpu_over_1ms),
            format!(
                "{:.0} ({:.0}), {:.0} ({:.0})",
                s.split.closing_busy.max_us,
                s.split.closing_busy_over_1ms,
                s.split.closing_busy_cpu.max_us,
                s.split.closing_busy_cpu_over_1ms
            ),
        ];
        for (i, op) in SHOWN.iter().enumerate() {
            let once = |cells: &[String]| {
                cells
                    .iter()
                    .map(|c| if i == 0 { c.clone() } else { String::new() })
                    .collect::<Vec<_>>()
            };
            let mut row = once(&step);
            row.extend([
                op.to_string(),
                pair(engines(s, op).as_ref()),
                pair(find(&s.split.served, op)),
                pair(find(&s.split.less_cpu_wait, op)),
                pair(find(&s.split.cpu_wait, op)),
            ]);
            row.extend(once(&loop_side));
            t.row(row);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "\
# TYPE maru_server_request_served_seconds histogram
maru_server_request_served_seconds_bucket{op=\"exists\",le=\"0.0001\"} 50
maru_server_request_served_seconds_bucket{op=\"exists\",le=\"0.001\"} 99
maru_server_request_served_seconds_bucket{op=\"exists\",le=\"+Inf\"} 100
maru_server_request_served_seconds_count{op=\"exists\"} 100
maru_server_request_served_seconds_bucket{op=\"close\",le=\"0.0001\"} 3
maru_server_request_served_seconds_bucket{op=\"close\",le=\"0.001\"} 3
maru_server_request_served_seconds_bucket{op=\"close\",le=\"+Inf\"} 3
";

    /// A step's quantiles come from the buckets it added, read within their bucket;
    /// `all` leaves out open and close.
    #[test]
    fn a_steps_quantiles_come_from_the_buckets_it_added() {
        let after = histograms(SCRAPE, "maru_server_request_served_seconds");
        assert_eq!(after["exists"].len(), 3);
        let before: BTreeMap<String, Buckets> = [(
            "exists".to_string(),
            vec![(0.0001, 40.0), (0.001, 40.0), (f64::INFINITY, 40.0)],
        )]
        .into();
        let d = step_buckets(&before, &after);
        // The step: 10 under 100 µs, 49 from 100 µs to 1 ms, 1 above.
        let l = lat_of_buckets(&d["exists"]);
        assert_eq!(l.count, 60);
        assert!(
            (l.p50_us - (100.0 + 900.0 * 20.0 / 49.0)).abs() < 1e-6,
            "{l:?}"
        );
        assert!((l.p99_us - 1000.0).abs() < 1e-6, "{l:?}");
        assert_eq!(d["all"].last().unwrap().1, 60.0, "close is not in all");
        assert!((quantile_us(&d["close"], 0.99) - 99.0).abs() < 1e-6);
    }
}
