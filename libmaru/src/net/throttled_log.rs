//! Log lines that peers can cause in bulk, as a few lines per interval.
//!
//! A connection that never proves the key, a handshake that times out, a refusal at
//! accept: each is one event a peer causes at no cost, so one log line each lets a
//! flood write the log at the flood's rate. Here the first such event after a quiet
//! interval is logged in full at once (what happened, from where), the rest of the
//! interval is only counted by kind, and one summary line follows when the interval
//! ends (`412 more in the last 10 s (400 no handshake in time, 12 key proof failed);
//! the last from 10.0.0.7:5112`). A flood of any rate costs one line per interval
//! after its first. The daemons' counters (metrics) still count every event.
//!
//! Sans-I/O: time comes in as `now_ms`; the lines come back to be written through
//! `log` ([`Line::emit`]).

use super::text::clip;
use std::collections::BTreeMap;

/// Default interval between summary lines (10 s).
pub const DEFAULT_INTERVAL_MS: u64 = 10_000;

/// A line to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub level: log::Level,
    pub text: String,
}

impl Line {
    /// Writes the line through `log` under `target` (the module of the caller, so a
    /// `RUST_LOG` filter on it keeps working).
    pub fn emit(&self, target: &str) {
        log::log!(target: target, self.level, "{}", self.text);
    }
}

/// Writes every line through `log` under `target` (see [`Line::emit`]).
pub fn emit(target: &str, lines: Vec<Line>) {
    for l in lines {
        l.emit(target);
    }
}

/// The bulk events of one listener.
#[derive(Debug)]
pub struct ThrottledLog {
    /// What the summary line speaks of ("maru-rm port: connections closed before the
    /// handshake").
    subject: &'static str,
    interval_ms: u64,
    /// Start of the interval under way: its first event was logged in full.
    since: Option<u64>,
    /// Events counted since, by kind.
    counts: BTreeMap<&'static str, u64>,
    /// The most severe level among them.
    level: log::Level,
    /// The peer of the last event counted.
    last_peer: String,
}

impl ThrottledLog {
    pub fn new(subject: &'static str, interval_ms: u64) -> ThrottledLog {
        ThrottledLog {
            subject,
            interval_ms: interval_ms.max(1),
            since: None,
            counts: BTreeMap::new(),
            level: log::Level::Debug,
            last_peer: String::new(),
        }
    }

    /// One event of `kind` (a short fixed phrase: "no handshake in time") from
    /// `peer`, at `level`; `full` is its whole line, asked for only when it is logged.
    /// Returns the lines to write now.
    pub fn note(
        &mut self,
        now_ms: u64,
        level: log::Level,
        kind: &'static str,
        peer: &str,
        full: impl FnOnce() -> String,
    ) -> Vec<Line> {
        let mut lines = self.due(now_ms);
        if self.since.is_none() {
            self.since = Some(now_ms);
            lines.push(Line {
                level,
                text: format!(
                    "{}: {} (more of these within {} s are summed up in one line)",
                    self.subject,
                    full(),
                    self.interval_ms / 1000
                ),
            });
            return lines;
        }
        *self.counts.entry(kind).or_default() += 1;
        // log::Level orders Error first: the smaller is the more severe.
        self.level = self.level.min(level);
        self.last_peer = clip(peer);
        lines
    }

    /// The summary line, once the interval under way has ended and events were
    /// counted in it; call it at [`ThrottledLog::next_deadline`].
    pub fn due(&mut self, now_ms: u64) -> Vec<Line> {
        let Some(since) = self.since else {
            return Vec::new();
        };
        if now_ms < since.saturating_add(self.interval_ms) {
            return Vec::new();
        }
        if self.counts.is_empty() {
            // A quiet interval: the next event is logged in full again.
            self.since = None;
            return Vec::new();
        }
        let n: u64 = self.counts.values().sum();
        let kinds: Vec<String> = self
            .counts
            .iter()
            .map(|(k, c)| format!("{c} {k}"))
            .collect();
        let line = Line {
            level: self.level,
            text: format!(
                "{}: {n} more in the last {} s ({}); the last from {}",
                self.subject,
                (now_ms - since).div_ceil(1000),
                kinds.join(", "),
                self.last_peer
            ),
        };
        self.counts.clear();
        self.level = log::Level::Debug;
        // Still busy: the next interval only counts too.
        self.since = Some(now_ms);
        vec![line]
    }

    /// When the next summary line is due (None: nothing counted).
    pub fn next_deadline(&self) -> Option<u64> {
        if self.counts.is_empty() {
            return None;
        }
        self.since.map(|s| s.saturating_add(self.interval_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_any_rate_costs_one_line_per_interval_after_its_first() {
        let mut t = ThrottledLog::new("test port", 10_000);
        let mut lines = Vec::new();
        // 10,000 events over 25 s (one every 2.5 ms), the loop checking its deadline
        // after each as the daemons do.
        for i in 0..10_000u64 {
            let now = i * 5 / 2;
            let (kind, level) = if i % 100 == 7 {
                ("key proof failed", log::Level::Warn)
            } else {
                ("no handshake in time", log::Level::Info)
            };
            lines.extend(
                t.note(now, level, kind, &format!("10.0.0.{}:1", i % 7), || {
                    format!("connection {i}: {kind}")
                }),
            );
            lines.extend(t.due(now));
        }
        lines.extend(t.due(40_000));
        assert_eq!(lines.len(), 1 + 3, "{lines:#?}");
        assert!(lines[0].text.contains("connection 0: no handshake in time"));
        assert!(
            lines[1].text.contains("3999 more in the last 10 s")
                && lines[1].text.contains("40 key proof failed")
                && lines[1].text.contains("3959 no handshake in time"),
            "{}",
            lines[1].text
        );
        assert_eq!(lines[1].level, log::Level::Warn, "the most severe level");
        let counted: u64 = lines[1..]
            .iter()
            .map(|l| {
                l.text
                    .split(": ")
                    .nth(1)
                    .and_then(|r| r.split(' ').next())
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap()
            })
            .sum();
        assert_eq!(
            counted, 9_999,
            "every event after the first is counted once"
        );
        assert!(lines.iter().all(|l| l.text.len() < 300));
    }

    #[test]
    fn after_a_quiet_interval_the_next_event_is_logged_in_full() {
        let mut t = ThrottledLog::new("p", 10_000);
        assert_eq!(
            t.note(0, log::Level::Info, "k", "a", || "first".into())
                .len(),
            1
        );
        assert_eq!(t.next_deadline(), None, "nothing to sum up");
        assert!(t
            .note(5_000, log::Level::Info, "k", "b", || "x".into())
            .is_empty());
        assert_eq!(t.next_deadline(), Some(10_000));
        let s = t.due(10_000);
        assert_eq!(s.len(), 1);
        assert!(s[0].text.contains("1 more") && s[0].text.contains("the last from b"));
        // Nothing in the next interval: the one after starts with a full line again.
        assert!(t.due(20_000).is_empty());
        let l = t.note(31_000, log::Level::Warn, "k", "c", || "again".into());
        assert_eq!(l.len(), 1);
        assert!(l[0].text.contains("again"));
        assert_eq!(l[0].level, log::Level::Warn);
    }

    #[test]
    fn peer_text_in_a_summary_is_cut_and_escaped() {
        let mut t = ThrottledLog::new("p", 1_000);
        t.note(0, log::Level::Info, "k", "a", || "first".into());
        let evil = format!("x\nFORGED{}", "y".repeat(1000));
        t.note(1, log::Level::Info, "k", &evil, || unreachable!());
        let s = t.due(1_000);
        assert!(
            !s[0].text.contains('\n') && s[0].text.len() < 400,
            "{}",
            s[0].text
        );
    }
}
