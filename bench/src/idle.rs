//! Idle CPU: user + system time from /proc/PID/stat (and /proc/self/task/TID/stat for
//! the handler's threads) over a quiet interval, as percent of one core.

use serde::Serialize;
use std::time::Instant;

/// Clock ticks per second (`_SC_CLK_TCK`): the unit of /proc's CPU times.
pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// utime + stime (clock ticks) in the text of a /proc stat file: fields of the part
/// after the command name, which may itself hold spaces and parentheses.
pub fn stat_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')' the fields are numbered from 3 (state); utime is 14, stime 15.
    let get = |i: usize| f.get(i - 3)?.parse::<u64>().ok();
    Some(get(14)? + get(15)?)
}

/// [`stat_ticks`] of a /proc stat file.
fn cpu_ticks(stat_path: &str) -> Result<u64, String> {
    let s = std::fs::read_to_string(stat_path).map_err(|e| format!("{stat_path}: {e}"))?;
    stat_ticks(&s).ok_or_else(|| format!("{stat_path}: no utime and stime after the command name"))
}

/// CPU ticks (user + system) of process `pid` so far, its threads that ended
/// included (`/proc/PID/stat`; summing `/proc/PID/task` misses those: a simulator's
/// working threads have ended by the time it writes its results); 0 when it cannot
/// be read.
pub fn process_ticks(pid: u32) -> u64 {
    cpu_ticks(&format!("/proc/{pid}/stat")).unwrap_or(0)
}

fn thread_name(tid: &str) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Ticks of every thread of this process except the calling one (which only sleeps).
fn own_threads() -> Vec<(String, String)> {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() }.to_string();
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|t| *t != me)
                .map(|t| {
                    let n = thread_name(&t);
                    (t, n)
                })
                .collect()
        })
        .unwrap_or_default()
}

#[derive(Debug, Clone, Serialize)]
pub struct IdleCpu {
    pub what: String,
    pub pct_of_core: f64,
    pub threads: usize,
}

/// Measures the given processes (name, pid) and this process's other threads (the
/// open handler's) over `secs` seconds of doing nothing.
pub fn measure(
    procs: &[(String, u32)],
    handler_label: &str,
    secs: f64,
) -> Result<Vec<IdleCpu>, String> {
    let threads = own_threads();
    let before_p: Vec<u64> = procs
        .iter()
        .map(|(_, pid)| cpu_ticks(&format!("/proc/{pid}/stat")))
        .collect::<Result<_, _>>()?;
    let before_t: Vec<u64> = threads
        .iter()
        .map(|(t, _)| cpu_ticks(&format!("/proc/self/task/{t}/stat")).unwrap_or(0))
        .collect();
    let start = Instant::now();
    crate::harness::idle_for(secs);
    let wall = start.elapsed().as_secs_f64();
    let hz = clk_tck();
    let pct = |d: u64| d as f64 / hz / wall * 100.0;
    let mut out = Vec::new();
    for ((name, pid), b) in procs.iter().zip(before_p) {
        let a = cpu_ticks(&format!("/proc/{pid}/stat"))?;
        let n = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| d.count())
            .unwrap_or(0);
        out.push(IdleCpu {
            what: name.clone(),
            pct_of_core: pct(a.saturating_sub(b)),
            threads: n,
        });
    }
    // A thread that ended during the interval counts with what it had used before.
    let mut d = 0;
    for ((t, _), b) in threads.iter().zip(before_t) {
        let a = cpu_ticks(&format!("/proc/self/task/{t}/stat")).unwrap_or(b);
        d += a.saturating_sub(b);
    }
    let names: Vec<&str> = threads.iter().map(|(_, n)| n.as_str()).collect();
    log_threads(&names);
    out.push(IdleCpu {
        what: handler_label.to_string(),
        pct_of_core: pct(d),
        threads: threads.len(),
    });
    Ok(out)
}

fn log_threads(names: &[&str]) {
    if std::env::var_os("MARU_BENCH_VERBOSE").is_some() {
        eprintln!("handler threads: {names:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::stat_ticks;

    /// utime (field 14) + stime (field 15), counted after the command name, which may
    /// hold spaces and parentheses of its own.
    #[test]
    fn stat_ticks_are_utime_and_stime_after_the_command_name() {
        let stat = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 100 23 0 0 20 0 1";
        assert_eq!(stat_ticks(stat), Some(123));
        assert_eq!(stat_ticks("4242 (cut) S 1 2"), None, "too few fields");
    }
}
