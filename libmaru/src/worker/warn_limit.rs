//! Warnings about a degraded state at most once per cause and subject per interval.
//! [`WarnLimit`] is the sans-I/O core (time passed in); [`allow`] the process's one.

use std::collections::HashMap;
use std::sync::Mutex;

/// At most one warning per cause and subject in this long.
pub(crate) const WARN_INTERVAL_MS: u64 = 10_000;

/// Subjects remembered at most (addresses come from configurations and maru-server's
/// handshakes, so this is never reached in practice; past it the oldest go).
const MAX_SUBJECTS: usize = 1024;

/// When each (subject, cause) was last warned about, and how many warnings were held
/// back since.
#[derive(Default)]
pub(crate) struct WarnLimit {
    last: HashMap<(String, &'static str), (u64, u64)>,
}

impl WarnLimit {
    /// `Some(held_back)` when a warning about `cause` of `subject` may be logged at
    /// `now_ms` (`held_back`: how many were not logged since the last one); `None`
    /// when one was logged less than [`WARN_INTERVAL_MS`] ago (it is counted).
    pub(crate) fn allow(&mut self, subject: &str, cause: &'static str, now_ms: u64) -> Option<u64> {
        let key = (subject.to_string(), cause);
        if let Some((at, held)) = self.last.get_mut(&key) {
            if now_ms.saturating_sub(*at) < WARN_INTERVAL_MS {
                *held += 1;
                return None;
            }
            let n = *held;
            (*at, *held) = (now_ms, 0);
            return Some(n);
        }
        if self.last.len() >= MAX_SUBJECTS {
            if let Some(oldest) = self
                .last
                .iter()
                .min_by_key(|(_, v)| v.0)
                .map(|(k, _)| k.clone())
            {
                self.last.remove(&oldest);
            }
        }
        self.last.insert(key, (now_ms, 0));
        Some(0)
    }
}

/// [`WarnLimit::allow`] on the process's limiter, now.
pub(crate) fn allow(subject: &str, cause: &'static str) -> Option<u64> {
    static LIMIT: Mutex<Option<WarnLimit>> = Mutex::new(None);
    let mut g = LIMIT.lock().unwrap_or_else(|p| p.into_inner());
    g.get_or_insert_with(WarnLimit::default)
        .allow(subject, cause, super::clock::now_ms())
}

/// " (N more like it since the last line)" when warnings were held back, else "".
pub(crate) fn held_back(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(
            " ({n} more like it in the last {} s)",
            WARN_INTERVAL_MS / 1000
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_cause_and_subject_per_interval() {
        let mut w = WarnLimit::default();
        assert_eq!(w.allow("pool-a", "no_room", 1_000), Some(0));
        assert_eq!(w.allow("pool-a", "no_room", 2_000), None);
        assert_eq!(w.allow("pool-a", "no_room", 10_999), None);
        // Another cause, another subject: their own lines.
        assert_eq!(w.allow("pool-a", "unavailable", 2_000), Some(0));
        assert_eq!(w.allow("pool-b", "no_room", 2_000), Some(0));
        // The interval passed: one line, saying how many were held back.
        assert_eq!(w.allow("pool-a", "no_room", 11_000), Some(2));
        assert_eq!(w.allow("pool-a", "no_room", 11_001), None);
        assert_eq!(held_back(0), "");
        assert!(held_back(2).contains("2 more"));
    }

    #[test]
    fn subjects_are_bounded() {
        let mut w = WarnLimit::default();
        for i in 0..(MAX_SUBJECTS as u64 + 10) {
            assert_eq!(w.allow(&format!("agent-{i}"), "silent", i), Some(0));
        }
        assert!(w.last.len() <= MAX_SUBJECTS);
        // The newest is still limited.
        let newest = format!("agent-{}", MAX_SUBJECTS + 9);
        assert_eq!(w.allow(&newest, "silent", MAX_SUBJECTS as u64 + 20), None);
    }
}
