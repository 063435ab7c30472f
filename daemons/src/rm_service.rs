//! The resource manager on the event loop: decode a request, run it through the
//! core, encode the reply. Owner tracking follows connections.

use crate::metrics::{Metrics, Refresh};
use crate::request;
use maru::net::{ConnId, Service};
use maru::rm::ResourceManager;
use maru::wire::rm::{RmReply, RmRequest, SERVICE};
use std::sync::Arc;
use std::time::Instant;

/// The RM's gauges (`maru_rm_<name>`).
pub const RM_GAUGES: &[(&str, &str)] = &[
    ("regions", "Regions allocated (draining ones included)"),
    ("holds", "Holds agents keep on regions"),
    ("pools", "Pools served"),
    ("pool_bytes", "Bytes usable for regions, over every pool"),
    (
        "pool_free_bytes",
        "Bytes free for new regions, over every pool",
    ),
    (
        "pool_draining_bytes",
        "Bytes of freed regions still held by an agent",
    ),
];

pub struct RmService {
    pub core: ResourceManager,
    host: String,
    /// Local owners whose connection closed while their process still ran (it may be
    /// exiting): checked again at the given time.
    recheck: Vec<(String, u64)>,
    /// The port's idle timeout, announced in the welcome so that owners keep their
    /// connection alive well within it (0: none).
    pub idle_timeout_ms: u64,
    /// `--metrics`: figures for Prometheus.
    metrics: Option<Arc<Metrics>>,
    refresh: Refresh,
    started: Instant,
}

/// How long after a local owner's last connection closed its process is checked again.
const RECHECK_MS: u64 = 500;

impl RmService {
    pub fn new(core: ResourceManager) -> RmService {
        RmService {
            core,
            host: maru::net::hostname(),
            recheck: Vec::new(),
            idle_timeout_ms: 0,
            metrics: None,
            refresh: Refresh::new(1000),
            started: Instant::now(),
        }
    }

    /// Counts requests into `m` and copies the core's figures into its gauges.
    pub fn with_metrics(mut self, m: Arc<Metrics>) -> RmService {
        self.metrics = Some(m);
        self
    }

    /// Copies the core's figures into the gauges (at most once a second).
    fn refresh_gauges(&mut self, now_ms: u64) {
        let Some(m) = self.metrics.clone() else {
            return;
        };
        if !self.refresh.due(now_ms) {
            return;
        }
        let me = "maru-rm-metrics";
        if let Ok(RmReply::Regions { regions }) =
            self.core
                .handle(me, RmRequest::Regions { owner: None }, now_ms)
        {
            m.set("regions", regions.len() as i64);
        }
        if let Ok(RmReply::Holds { holds }) =
            self.core
                .handle(me, RmRequest::Holds { node: None }, now_ms)
        {
            m.set("holds", holds.len() as i64);
        }
        if let Ok(RmReply::Pools { pools }) = self.core.handle(me, RmRequest::Pools, now_ms) {
            m.set("pools", pools.len() as i64);
            let sum =
                |f: fn(&maru::wire::rm::PoolInfo) -> u64| pools.iter().map(f).sum::<u64>() as i64;
            m.set("pool_bytes", sum(|p| p.total));
            m.set("pool_free_bytes", sum(|p| p.free));
            m.set("pool_draining_bytes", sum(|p| p.draining));
        }
    }

    /// The pid of a client id `[name@]host:pid` of this host.
    fn local_pid(&self, client_id: &str) -> Option<u32> {
        let (who, pid) = client_id.rsplit_once(':')?;
        let host = who.rsplit_once('@').map_or(who, |(_, h)| h);
        let pid = pid.parse::<u32>().ok()?;
        (host == self.host && pid > 0).then_some(pid)
    }

    fn reap_if_gone(&mut self, client_id: &str) -> bool {
        if self.local_pid(client_id).is_some_and(|p| !process_alive(p)) {
            let reaped = self.core.owner_gone(client_id);
            if !reaped.is_empty() {
                log::info!("owner {client_id} exited: freed regions {reaped:?}");
            }
            return true;
        }
        false
    }
}

/// Whether process `pid` runs: its /proc entry exists and it is not a zombie (an
/// exited process its parent has not reaped yet holds no memory mapping any more).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => match stat.rsplit_once(')') {
            Some((_, rest)) => !matches!(rest.trim_start().chars().next(), Some('Z') | Some('X')),
            None => true,
        },
        Err(_) => false,
    }
}

impl Service for RmService {
    fn service_name(&self) -> &'static str {
        SERVICE
    }

    fn welcome_info(&self) -> serde_json::Value {
        serde_json::json!({
            "idle_timeout_ms": self.idle_timeout_ms,
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_s": self.started.elapsed().as_secs(),
        })
    }

    fn on_open(
        &mut self,
        _conn: ConnId,
        client_id: &str,
        _key_name: Option<&str>,
        _resume: Option<&str>,
        _now_ms: u64,
    ) {
        self.core.client_connected(client_id);
    }

    fn on_request(&mut self, _conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        let metrics = self.metrics.as_deref();
        let (req, body) = match request::decode::<RmRequest>(body, client_id, metrics) {
            Ok(r) => r,
            Err(reply) => return reply,
        };
        let result = self.core.handle(client_id, body, now_ms);
        let frame = req.reply(result, client_id, log::Level::Debug, metrics);
        if self.metrics.is_some() {
            self.refresh.touch();
            self.refresh_gauges(now_ms);
        }
        frame
    }

    fn on_close(&mut self, _conn: ConnId, client_id: &str, now_ms: u64) {
        self.core.client_disconnected(client_id, now_ms);
        if !self.reap_if_gone(client_id) && self.local_pid(client_id).is_some() {
            self.recheck
                .push((client_id.to_string(), now_ms + RECHECK_MS));
        }
    }

    fn on_tick(&mut self, now_ms: u64) {
        let due: Vec<String> = self
            .recheck
            .iter()
            .filter(|(_, t)| *t <= now_ms)
            .map(|(c, _)| c.clone())
            .collect();
        self.recheck.retain(|(_, t)| *t > now_ms);
        for c in due {
            self.reap_if_gone(&c);
        }
        let reaped = self.core.tick(now_ms);
        if !reaped.is_empty() {
            log::info!(
                "grace period over: freed regions {reaped:?} of owners that did not come back"
            );
            self.refresh.touch();
        }
        self.refresh_gauges(now_ms);
    }

    fn next_deadline(&self) -> Option<u64> {
        let recheck = self.recheck.iter().map(|(_, t)| *t).min();
        let gauges = self.metrics.as_ref().and_then(|_| self.refresh.deadline());
        [self.core.next_deadline(), recheck, gauges]
            .into_iter()
            .flatten()
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_alive_sees_running_and_gone_processes() {
        assert!(process_alive(std::process::id()));
        // Above the kernel's pid_max limit (4194304): never a process.
        assert!(!process_alive(4_194_305));
        // A child that exited but was not reaped yet is a zombie: not alive.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let mut zombie = false;
        for _ in 0..200 {
            if !process_alive(pid) {
                zombie = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(zombie, "an exited, unreaped child counts as gone");
        child.wait().unwrap();
    }
}
