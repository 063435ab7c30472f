//! The resource manager on the event loop: decode a request, run it through the
//! core, encode the reply. Owner tracking follows connections.

use maru::net::{ConnId, Service};
use maru::rm::ResourceManager;
use maru::wire::{self, rm::RmRequest, rm::SERVICE, Envelope};

pub struct RmService {
    pub core: ResourceManager,
    host: String,
    /// Local owners whose connection closed while their process still ran (it may be
    /// exiting): checked again at the given time.
    recheck: Vec<(String, u64)>,
    /// The port's idle timeout, announced in the welcome so that owners keep their
    /// connection alive well within it (0: none).
    pub idle_timeout_ms: u64,
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
        serde_json::json!({ "idle_timeout_ms": self.idle_timeout_ms })
    }

    fn on_open(&mut self, _conn: ConnId, client_id: &str, _resume: Option<&str>, _now_ms: u64) {
        self.core.client_connected(client_id);
    }

    fn on_request(&mut self, _conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        let env: Envelope<RmRequest> = match wire::decode_json(body) {
            Ok(e) => e,
            Err(e) => {
                log::info!("bad request from {client_id}: {}", e.message);
                return wire::reply_frame::<()>(wire::request_id_of(body), Err(e));
            }
        };
        let result = self.core.handle(client_id, env.body, now_ms);
        if let Err(e) = &result {
            log::debug!("request {} from {client_id} failed: {e}", env.id);
        }
        wire::reply_frame(env.id, result)
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
        }
    }

    fn next_deadline(&self) -> Option<u64> {
        let recheck = self.recheck.iter().map(|(_, t)| *t).min();
        match (self.core.next_deadline(), recheck) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
