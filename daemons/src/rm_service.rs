//! The resource manager on the event loop: decode a request, run it through the
//! core, encode the reply. Owner tracking follows connections.

use maru::net::{ConnId, Service};
use maru::rm::ResourceManager;
use maru::wire::{self, rm::RmRequest, rm::SERVICE, Envelope};

pub struct RmService {
    pub core: ResourceManager,
    host: String,
}

impl RmService {
    pub fn new(core: ResourceManager) -> RmService {
        RmService {
            core,
            host: maru::net::hostname(),
        }
    }

    /// A client id of the form `host:pid` of this host whose process is gone.
    fn local_owner_dead(&self, client_id: &str) -> bool {
        let Some((host, pid)) = client_id.rsplit_once(':') else {
            return false;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            return false;
        };
        host == self.host && pid > 0 && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    }
}

impl Service for RmService {
    fn service_name(&self) -> &'static str {
        SERVICE
    }

    fn on_open(&mut self, _conn: ConnId, client_id: &str, _now_ms: u64) {
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
        if self.local_owner_dead(client_id) {
            let reaped = self.core.owner_gone(client_id);
            if !reaped.is_empty() {
                log::info!("owner {client_id} exited: freed regions {reaped:?}");
            }
        }
    }

    fn on_tick(&mut self, now_ms: u64) {
        let reaped = self.core.tick(now_ms);
        if !reaped.is_empty() {
            log::info!(
                "grace period over: freed regions {reaped:?} of owners that did not come back"
            );
        }
    }

    fn next_deadline(&self) -> Option<u64> {
        self.core.next_deadline()
    }
}
